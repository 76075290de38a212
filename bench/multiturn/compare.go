package multiturn

import (
	"fmt"
	"io"
	"math"
	"strings"
)

// WriteComparison prints two summaries side by side: requests/s, the mean and percentiles of
// TTFT, TPOT and latency, and the mean TTFT per user turn, each with the ratio B ÷ A.
func WriteComparison(w io.Writer, nameA, nameB string, a, b *Summary) error {
	var sb strings.Builder
	ratio := func(x, y float64) string {
		if math.IsNaN(x) || math.IsNaN(y) || x == 0 {
			return "-"
		}
		return fmt.Sprintf("%.3f", y/x)
	}
	num := func(v float64) string {
		if math.IsNaN(v) {
			return "-"
		}
		return fmt.Sprintf("%.2f", v)
	}
	wA, wB := max(len(nameA), 10), max(len(nameB), 10)
	row := func(label string, x, y float64) {
		fmt.Fprintf(&sb, "%-20s %*s %*s %8s\n", label, wA, num(x), wB, num(y), ratio(x, y))
	}
	fmt.Fprintf(&sb, "A = %s\nB = %s\n", nameA, nameB)
	fmt.Fprintf(&sb, "%-20s %*s %*s %8s\n", "metric", wA, "A", wB, "B", "B/A")
	row("requests", float64(a.NumRequests), float64(b.NumRequests))
	row("requests_per_sec", a.RequestsPerSec, b.RequestsPerSec)
	for _, m := range []string{"ttft_ms", "tpot_ms", "latency_ms"} {
		sa, okA := a.Metrics[m]
		sbb, okB := b.Metrics[m]
		if !okA && !okB {
			continue
		}
		get := func(s Stat, ok bool, q float64) float64 {
			if !ok {
				return math.NaN()
			}
			if q == 0 {
				return s.Mean
			}
			v, _ := s.Percentile(q)
			return v
		}
		row(m+" mean", get(sa, okA, 0), get(sbb, okB, 0))
		row(m+" p50", get(sa, okA, 0.5), get(sbb, okB, 0.5))
		row(m+" p90", get(sa, okA, 0.9), get(sbb, okB, 0.9))
	}
	ya, yb := turnSeries(a), turnSeries(b)
	if n := max(len(ya), len(yb)); n > 0 {
		sb.WriteString("\nmean TTFT per user turn (ms):\n")
		fmt.Fprintf(&sb, "%-20s %*s %*s %8s\n", "turn", wA, "A", wB, "B", "B/A")
		at := func(y []float64, i int) float64 {
			if i < len(y) {
				return y[i]
			}
			return math.NaN()
		}
		for i := range n {
			row(fmt.Sprint(i+1), at(ya, i), at(yb, i))
		}
	}
	_, err := io.WriteString(w, sb.String())
	return err
}
