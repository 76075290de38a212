package multiturn

import (
	"fmt"
	"io"
	"math"
	"strings"
)

// separator is the report's rule line (vLLM's TEXT_SEPARATOR).
const separator = "----------------------------------------------------------------------------------------------------"

// WriteReport prints the summary as vLLM's benchmark does — the Parameters block, the
// Conversations Generation Parameters block, then per warm-up window runtime_sec,
// requests_per_sec and the statistics table — followed by kvbridge's additions: how tokens were
// counted, notices, failures, and the mean TTFT per user turn.
func WriteReport(w io.Writer, s *Summary) error {
	var b strings.Builder
	b.WriteString(separator + "\n")
	b.WriteString("Parameters:\n")
	for _, p := range s.Parameters {
		fmt.Fprintf(&b, "%s=%v\n", p.Key, p.Value)
	}
	if len(s.GenerationParameters) > 0 {
		b.WriteString("Conversations Generation Parameters:\n")
		for _, p := range s.GenerationParameters {
			fmt.Fprintf(&b, "%s=%v\n", p.Key, p.Value)
		}
	}
	fmt.Fprintf(&b, "token_counter=%s\n", s.TokenCounter)
	for _, n := range s.Notices {
		fmt.Fprintf(&b, "notice: %s\n", n)
	}
	b.WriteString(separator + "\n")
	if len(s.Windows) == 0 {
		b.WriteString("No samples to process\n")
	}
	for _, win := range s.Windows {
		if win.WarmupPercent > 0 || len(s.Windows) > 1 {
			fmt.Fprintf(&b, "Statistics summary (assuming %.0f%% warmup samples):\n", win.WarmupPercent)
		} else {
			b.WriteString("Statistics summary:\n")
		}
		fmt.Fprintf(&b, "runtime_sec = %.3f\n", win.RuntimeSec)
		fmt.Fprintf(&b, "requests_per_sec = %.3f\n", win.RequestsPerSec)
		if s.WarmupRuntimeSec != nil {
			fmt.Fprintf(&b, "warmup_runtime_sec = %.3f\n", *s.WarmupRuntimeSec)
			fmt.Fprintf(&b, "total_runtime_incl_warmup_sec = %.3f\n", win.RuntimeSec+*s.WarmupRuntimeSec)
		}
		b.WriteString(separator + "\n")
		writeStatTable(&b, win.Metrics)
		b.WriteString(separator + "\n")
	}
	if s.NumFailedRequests > 0 {
		fmt.Fprintf(&b, "failed_requests = %d\n", s.NumFailedRequests)
	}
	fmt.Fprintf(&b, "finished_conversations = %d of %d\n", s.NumConversationsFinished, s.NumConversations)
	if len(s.TTFTMsByTurn) > 0 {
		b.WriteString("Mean TTFT per user turn:\n")
		fmt.Fprintf(&b, "%6s %9s %10s\n", "turn", "requests", "ttft_ms")
		for i, v := range s.TTFTMsByTurn {
			val := "-"
			if v != nil {
				val = fmt.Sprintf("%.2f", *v)
			}
			fmt.Fprintf(&b, "%6d %9d %10s\n", i+1, s.RequestsByTurn[i], val)
		}
		b.WriteString(separator + "\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// writeStatTable prints the metrics present in metrics, in MetricNames order.
func writeStatTable(b *strings.Builder, metrics map[string]Stat) {
	var (
		names []string
		stats []Stat
	)
	for _, name := range MetricNames() {
		if st, ok := metrics[name]; ok {
			names = append(names, name)
			stats = append(stats, st)
		}
	}
	writeStatTableRows(b, names, stats)
}

// writeStatTableRows prints stats as pandas prints describe().transpose(): one row per name,
// right-aligned columns, two decimals (one when a whole column holds integers), NaN for
// missing values. All stats must have the same percentiles.
func writeStatTableRows(b *strings.Builder, names []string, stats []Stat) {
	if len(stats) == 0 {
		return
	}
	header, _ := stats[0].columns()
	rows := make([][]float64, len(stats))
	for i, st := range stats {
		_, rows[i] = st.columns()
	}
	cells := make([][]string, len(names))
	for i := range names {
		cells[i] = make([]string, len(header))
	}
	widths := make([]int, len(header))
	for c := range header {
		integral := true
		for i := range names {
			v := rows[i][c]
			if !math.IsNaN(v) && v != math.Trunc(v) {
				integral = false
			}
		}
		format := "%.2f"
		if integral {
			format = "%.1f"
		}
		widths[c] = len(header[c])
		for i := range names {
			v := rows[i][c]
			s := "NaN"
			if !math.IsNaN(v) {
				s = fmt.Sprintf(format, v)
			}
			cells[i][c] = s
			widths[c] = max(widths[c], len(s))
		}
	}
	nameW := 0
	for _, n := range names {
		nameW = max(nameW, len(n))
	}
	fmt.Fprintf(b, "%-*s", nameW, "")
	for c, h := range header {
		fmt.Fprintf(b, "  %*s", widths[c], h)
	}
	b.WriteByte('\n')
	for i, n := range names {
		fmt.Fprintf(b, "%-*s", nameW, n)
		for c := range header {
			fmt.Fprintf(b, "  %*s", widths[c], cells[i][c])
		}
		b.WriteByte('\n')
	}
}
