package routebench

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"text/tabwriter"
)

// WriteTable prints the rows, one per policy, with kv-aware's hit rate against the oracle's and
// its TTFT p50 against round-robin's when both were run.
func WriteTable(w io.Writer, rows []Row) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "policy\trequests\thit rate\toracle\thit/oracle\tTTFT p50 ms\tTTFT p99 ms\tmax load/mean\tCPU µs/req\tdiffering\t")
	var rr, kv *Row
	for i, r := range rows {
		fmt.Fprintf(tw, "%s\t%d\t%.3f\t%.3f\t%.2f\t%.1f\t%.1f\t%.2f\t%.0f\t%d\t\n", r.Policy, r.Requests, r.HitRate, r.OracleHitRate, r.HitOfOracle,
			r.TTFTP50Ms, r.TTFTP99Ms, r.MaxLoadOfMean, r.CPUUsPerReq, r.Differing)
		switch r.Policy {
		case "round-robin":
			rr = &rows[i]
		case "kv-aware":
			kv = &rows[i]
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if rr != nil && kv != nil && rr.TTFTP50Ms > 0 {
		_, err := fmt.Fprintf(w, "kv-aware: hit rate %.2f of the oracle's (target ≥ 0.9), TTFT p50 %.2f× round-robin's (target ≤ 0.6), max load %.2f× the mean (target ≤ 1.5)\n",
			kv.HitOfOracle, kv.TTFTP50Ms/rr.TTFTP50Ms, kv.MaxLoadOfMean)
		return err
	}
	return nil
}

// WriteJSON writes the rows to path.
func WriteJSON(path string, rows []Row) error {
	data, err := json.MarshalIndent(rows, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(data, '\n'), 0o644)
}
