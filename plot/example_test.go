package plot_test

import (
	"fmt"
	"os"
	"strings"

	"github.com/kvbridge/kvbridge/plot"
)

// A line chart of mean TTFT per turn for two runs.
func ExampleLineChart() {
	var sb strings.Builder
	err := plot.LineChart(&sb, plot.Chart{
		Title:  "TTFT per turn",
		XLabel: "turn",
		YLabel: "TTFT (ms)",
		Series: []plot.Series{
			{Name: "one-way", Y: []float64{120, 180, 240, 300}},
			{Name: "bidirectional", Y: []float64{120, 60, 65, 70}},
		},
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return
	}
	fmt.Println(strings.HasPrefix(sb.String(), "<?xml"))
	// Output: true
}
