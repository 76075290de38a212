package xferbench

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"text/tabwriter"
)

// WriteTable prints the rows as an aligned table.
func WriteTable(w io.Writer, rows []Row) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "backend\top\tblock\tbatch\tGB/s\tpost avg µs\tpost p99 µs\txfer avg µs\txfer p50 µs\txfer p99 µs\tceiling GB/s\tceiling\tratio\tdescs\thot TCP GB/s\tvs TCP\tvs SHM\t")
	opt := func(v float64) string {
		if v > 0 {
			return fmt.Sprintf("%.2f", v)
		}
		return "-"
	}
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%.2f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.2f\t%s\t%.2f\t%d→%d\t%s\t%s\t%s\t\n",
			r.Backend, r.Op, sizeName(r.BlockBytes), r.Batch, r.GBps, r.PostAvgUs, r.PostP99Us,
			r.XferAvgUs, r.XferP50Us, r.XferP99Us, r.CeilingGBps, r.Ceiling, r.Ratio, r.Descs, r.MergedDescs,
			opt(r.TCPHotGBps), opt(r.VsTCP), opt(r.VsSHM))
	}
	return tw.Flush()
}

// WriteJSON writes the rows to path as a JSON array.
func WriteJSON(path string, rows []Row) error {
	b, err := json.MarshalIndent(rows, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}
