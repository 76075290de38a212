package multiturn

import (
	"fmt"
	"io"
	"math"
	"os"

	"github.com/kvbridge/kvbridge/plot"
)

// turnSeries converts TTFTMsByTurn to plot values (NaN for turns without samples).
func turnSeries(s *Summary) []float64 {
	y := make([]float64, len(s.TTFTMsByTurn))
	for i, v := range s.TTFTMsByTurn {
		y[i] = math.NaN()
		if v != nil {
			y[i] = *v
		}
	}
	return y
}

// WriteTTFTChart draws the mean TTFT per user turn of each summary as one line of an SVG chart;
// names label the lines (one per summary).
func WriteTTFTChart(w io.Writer, title string, names []string, sums ...*Summary) error {
	if len(names) != len(sums) {
		return fmt.Errorf("chart: %d names for %d summaries", len(names), len(sums))
	}
	c := plot.Chart{Title: title, XLabel: "user turn", YLabel: "mean TTFT (ms)"}
	for i, s := range sums {
		c.Series = append(c.Series, plot.Series{Name: names[i], Y: turnSeries(s)})
	}
	if err := plot.LineChart(w, c); err != nil {
		return fmt.Errorf("chart: %w", err)
	}
	return nil
}

// WriteTTFTChartFile is WriteTTFTChart into a new file at path.
func WriteTTFTChartFile(path, title string, names []string, sums ...*Summary) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("chart: %w", err)
	}
	err = WriteTTFTChart(f, title, names, sums...)
	if cerr := f.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("chart: %w", cerr)
	}
	return err
}
