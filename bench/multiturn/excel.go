package multiturn

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/xuri/excelize/v2"
)

// ExcelFileName is the name vLLM's script gives its -e/--excel-output workbook:
// statistics_<clients>_clients__<dd-mm-YYYY_HH-MM-SS>.xlsx.
func ExcelFileName(numClients int, now time.Time) string {
	return fmt.Sprintf("statistics_%d_clients__%s.xlsx", numClients, now.Format("02-01-2006_15-04-05"))
}

// WriteExcel writes the workbook of vLLM's -e/--excel-output: a "Summary" sheet with the
// parameters, the conversation generation parameters, and per warm-up window its runtime and
// the describe() table of every metric, laid out row for row as pandas writes them; and a
// "Raw data" sheet with one row per request, sorted by start time (with -v, the time since the
// previous turn of the same conversation too).
func WriteExcel(path string, s *Summary, samples []RequestStats, verbose bool) error {
	f := excelize.NewFile()
	defer f.Close()
	const summary, raw = "Summary", "Raw data"
	if err := f.SetSheetName("Sheet1", summary); err != nil {
		return err
	}
	if _, err := f.NewSheet(raw); err != nil {
		return err
	}
	x := &sheetWriter{f: f}
	x.summary(summary, s)
	x.raw(raw, samples, verbose)
	if x.err != nil {
		return fmt.Errorf("excel %s: %w", path, x.err)
	}
	if err := f.SaveAs(path); err != nil {
		return fmt.Errorf("excel %s: %w", path, err)
	}
	return nil
}

// sheetWriter writes rows into a workbook, keeping the first error.
type sheetWriter struct {
	f   *excelize.File
	err error
}

// row writes values from column A of 0-based row r.
func (x *sheetWriter) row(sheet string, r int, vals ...any) {
	if x.err != nil {
		return
	}
	cell, err := excelize.CoordinatesToCellName(1, r+1)
	if err == nil {
		for i, v := range vals {
			if f, ok := v.(float64); ok && (math.IsNaN(f) || math.IsInf(f, 0)) {
				vals[i] = nil // pandas writes NaN as an empty cell
			}
		}
		err = x.f.SetSheetRow(sheet, cell, &vals)
	}
	x.err = err
}

// params writes ps as two rows from 0-based row r: the keys, then the values.
func (x *sheetWriter) params(sheet string, r int, ps Params) {
	keys, vals := make([]any, len(ps)), make([]any, len(ps))
	for i, p := range ps {
		keys[i], vals[i] = p.Key, p.Value
	}
	x.row(sheet, r, keys...)
	x.row(sheet, r+1, vals...)
}

// summary writes the Summary sheet: the parameters, the generation parameters, and per warm-up
// window its runtime and the describe() table of every metric.
func (x *sheetWriter) summary(sheet string, s *Summary) {
	start := 0
	x.params(sheet, start, s.Parameters)
	start += 1 + 3
	if len(s.GenerationParameters) > 0 {
		x.params(sheet, start-1, s.GenerationParameters)
		start += 1 + 3
	}
	for _, w := range s.Windows {
		wp := Params{{"runtime_sec", w.RuntimeSec}, {"requests_per_sec", w.RequestsPerSec}}
		if s.WarmupRuntimeSec != nil {
			wp = append(wp, Param{"warmup_runtime_sec", *s.WarmupRuntimeSec}, Param{"total_runtime_incl_warmup_sec", w.RuntimeSec + *s.WarmupRuntimeSec})
		}
		x.params(sheet, start, wp)
		start += 1 + 2
		names := MetricNames()
		cols, _ := w.Metrics[names[0]].columns()
		header := []any{""}
		for _, c := range cols {
			header = append(header, c)
		}
		x.row(sheet, start, header...)
		for i, name := range names {
			_, vals := w.Metrics[name].columns()
			line := []any{name}
			for _, v := range vals {
				line = append(line, v)
			}
			x.row(sheet, start+1+i, line...)
		}
		start += 1 + len(names) + 3
	}
}

// raw writes the Raw data sheet: one row per request, sorted by start time, with (verbose) the
// time since the previous turn of the same conversation.
func (x *sheetWriter) raw(sheet string, samples []RequestStats, verbose bool) {
	// The rows are ordered through index permutations; samples itself is only read.
	header := []any{"ttft_ms", "tpot_ms", "latency_ms", "start_time_ms", "input_num_turns", "input_num_tokens",
		"output_num_tokens", "output_num_chunks", "output_num_first_chunk_tokens", "approx_cached_percent",
		"conversation_id", "client_id"}
	var between map[int]float64
	if verbose {
		header = append(header, "time_between_user_turns_sec")
		between = timeBetweenTurns(samples)
	}
	header = append(header, "end_time_ms")
	order := make([]int, len(samples))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmpFloat(samples[a].StartTimeMs, samples[b].StartTimeMs) })
	x.row(sheet, 0, header...)
	for k, i := range order {
		r := samples[i]
		line := []any{r.TTFTMs, r.TPOTMs, r.LatencyMs, r.StartTimeMs, r.InputNumTurns, r.InputNumTokens, r.OutputNumTokens,
			r.OutputNumChunks, r.OutputNumFirstChunkTokens, r.ApproxCachedPercent, r.ConversationID, r.ClientID}
		if verbose {
			v, ok := between[i]
			if !ok {
				v = math.NaN()
			}
			line = append(line, v)
		}
		x.row(sheet, k+1, append(line, r.StartTimeMs+r.LatencyMs)...)
	}
}

// timeBetweenTurns returns, by sample index, the seconds since the previous sample of the same
// conversation (none for a conversation's first).
func timeBetweenTurns(samples []RequestStats) map[int]float64 {
	between := map[int]float64{}
	idx := make([]int, len(samples))
	for i := range idx {
		idx[i] = i
	}
	slices.SortStableFunc(idx, func(a, b int) int {
		if c := cmp.Compare(samples[a].ConversationID, samples[b].ConversationID); c != 0 {
			return c
		}
		return cmpFloat(samples[a].StartTimeMs, samples[b].StartTimeMs)
	})
	for k := 1; k < len(idx); k++ {
		a, b := samples[idx[k-1]], samples[idx[k]]
		if a.ConversationID == b.ConversationID {
			between[idx[k]] = (b.StartTimeMs - a.StartTimeMs) / 1000
		}
	}
	return between
}
