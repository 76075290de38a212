// Package plot renders small, dependency-free SVG charts: a line chart of named series over
// x = 1..N (for example mean TTFT per turn, one run per series) and a grouped bar chart.
//
// The output is a complete, well-formed SVG document sized Chart.Width × Chart.Height pixels,
// with axes, tick labels, axis labels, a title and a legend. Values map to coordinates
// monotonically: a larger y is drawn higher, a larger x further right. NaN values are treated as
// missing (a gap in a line, no bar); infinite values are an error.
//
//	err := plot.LineChart(f, plot.Chart{
//		Title:  "TTFT per turn",
//		XLabel: "turn", YLabel: "TTFT (ms)",
//		Series: []plot.Series{{Name: "one-way", Y: a}, {Name: "bidirectional", Y: b}},
//	})
//
// See docs/architecture.md for where the package sits among kvbridge's packages.
package plot

import (
	"errors"
	"fmt"
	"math"
)

// ErrNoData is returned when a chart has no series or no finite value to draw.
var ErrNoData = errors.New("plot: no data to draw")

// ErrBadValue is returned when a series holds an infinite value.
var ErrBadValue = errors.New("plot: infinite value")

// Default dimensions used when Chart.Width or Chart.Height is zero.
const (
	DefaultWidth  = 720
	DefaultHeight = 420
)

// Series is one named sequence of values. In a line chart Y[i] is plotted at x = i+1; in a bar
// chart Y[i] is this series' bar in group i. A NaN entry is missing.
type Series struct {
	Name string
	Y    []float64
	// Color is an SVG colour ("#1f77b4", "teal"); empty picks the next colour of the palette.
	Color string
}

// Chart describes one chart. The zero value of every field except Series is usable.
type Chart struct {
	Title  string
	XLabel string
	YLabel string
	// Categories labels the x positions: in a line chart Categories[i] replaces the tick label
	// "i+1"; in a bar chart it names group i (groups without a name are labelled i+1).
	Categories []string
	Series     []Series
	// Width and Height are the size in pixels; zero means DefaultWidth × DefaultHeight.
	Width, Height int
	// YMin and YMax fix the y range when YMax > YMin; otherwise the range is derived from the
	// data and always includes 0.
	YMin, YMax float64
}

// colorOf returns series i's colour: its own, or the next of a colour-blind-friendly palette
// (Okabe–Ito order).
func colorOf(s Series, i int) string {
	if s.Color != "" {
		return s.Color
	}
	palette := [...]string{"#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000"}
	return palette[i%len(palette)]
}

// geometry is the plotting area inside the margins and the value ranges mapped onto it.
type geometry struct {
	width, height         float64
	left, right, top, bot float64 // plot-area edges in pixels
	ymin, ymax            float64
	yticks                []float64
	legendRows            int
}

// validate checks the chart's data and returns the number of x positions and the finite min/max.
func validate(c Chart) (n int, lo, hi float64, err error) {
	if len(c.Series) == 0 {
		return 0, 0, 0, ErrNoData
	}
	lo, hi = math.Inf(1), math.Inf(-1)
	for _, s := range c.Series {
		n = max(n, len(s.Y))
		for i, v := range s.Y {
			if math.IsInf(v, 0) {
				return 0, 0, 0, fmt.Errorf("%w: series %q point %d", ErrBadValue, s.Name, i+1)
			}
			if math.IsNaN(v) {
				continue
			}
			lo, hi = min(lo, v), max(hi, v)
		}
	}
	if math.IsInf(lo, 1) {
		return 0, 0, 0, ErrNoData
	}
	return n, lo, hi, nil
}

// layout computes margins, the y range and its ticks.
func layout(c Chart, lo, hi float64) geometry {
	g := geometry{width: float64(c.Width), height: float64(c.Height)}
	if c.Width <= 0 {
		g.width = DefaultWidth
	}
	if c.Height <= 0 {
		g.height = DefaultHeight
	}
	if c.YMax > c.YMin {
		lo, hi = c.YMin, c.YMax
	} else {
		lo, hi = min(lo, 0), max(hi, 0)
		if hi == lo {
			hi = lo + 1
		}
	}
	g.ymin, g.ymax, g.yticks = niceRange(lo, hi, 5, c.YMax > c.YMin)
	// Legend: entries laid out left to right, wrapping to new rows.
	g.legendRows = legendRows(c.Series, g.width-140)
	g.left = 70
	g.right = g.width - 20
	g.top = 40
	if c.Title == "" {
		g.top = 20
	}
	g.bot = g.height - 50 - float64(g.legendRows)*18
	if g.bot-g.top < 40 { // tiny canvases: keep a usable plot area
		g.bot = g.top + 40
	}
	return g
}

// yPix maps a value to a vertical pixel coordinate (larger values are higher, i.e. smaller y).
func (g geometry) yPix(v float64) float64 {
	return g.bot - (v-g.ymin)/(g.ymax-g.ymin)*(g.bot-g.top)
}

// niceRange extends [lo, hi] to round tick values (1, 2, 2.5 or 5 × 10^k) and returns about
// want ticks. With fixed set the range itself is kept and only the ticks are rounded.
func niceRange(lo, hi float64, want int, fixed bool) (float64, float64, []float64) {
	step := niceStep((hi - lo) / float64(want))
	nlo, nhi := lo, hi
	if !fixed {
		nlo = math.Floor(lo/step) * step
		nhi = math.Ceil(hi/step) * step
	}
	var ticks []float64
	first := math.Ceil(nlo/step-1e-9) * step
	for i := 0; ; i++ {
		t := first + float64(i)*step
		if t > nhi+step*1e-9 || i > 1000 {
			break
		}
		if math.Abs(t) < step*1e-9 {
			t = 0
		}
		ticks = append(ticks, t)
	}
	return nlo, nhi, ticks
}

// niceStep rounds raw up to 1, 2, 2.5 or 5 times a power of ten.
func niceStep(raw float64) float64 {
	if raw <= 0 || math.IsNaN(raw) {
		return 1
	}
	exp := math.Pow(10, math.Floor(math.Log10(raw)))
	for _, m := range []float64{1, 2, 2.5, 5, 10} {
		if raw <= m*exp*(1+1e-9) {
			return m * exp
		}
	}
	return 10 * exp
}

// formatTick prints a tick value compactly (no trailing zeros, thousands as "k" above 10000).
func formatTick(v float64) string {
	if v != 0 && math.Abs(v) >= 10000 {
		return trimFloat(v/1000) + "k"
	}
	return trimFloat(v)
}

// trimFloat prints v with up to 3 decimals and no trailing zeros.
func trimFloat(v float64) string {
	s := fmt.Sprintf("%.3f", v)
	for s[len(s)-1] == '0' {
		s = s[:len(s)-1]
	}
	if s[len(s)-1] == '.' {
		s = s[:len(s)-1]
	}
	if s == "-0" {
		s = "0"
	}
	return s
}

// legendRows counts the rows the legend needs within avail pixels.
func legendRows(series []Series, avail float64) int {
	rows, x := 1, 0.0
	for _, s := range series {
		w := legendEntryWidth(s.Name)
		if x > 0 && x+w > avail {
			rows++
			x = 0
		}
		x += w
	}
	return rows
}

// legendEntryWidth approximates the width of one legend entry (swatch, gap, text, padding).
func legendEntryWidth(name string) float64 {
	return 30 + 7*float64(len([]rune(name))) + 16
}

// xTickStride picks a label stride so that at most about maxLabels x labels are printed.
func xTickStride(n int, plotWidth float64) int {
	maxLabels := max(int(plotWidth/40), 1)
	stride := 1
	for n/stride > maxLabels {
		switch {
		case stride < 2:
			stride = 2
		case stride < 5:
			stride = 5
		default:
			stride *= 2
		}
	}
	return stride
}
