package pdbench

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
)

// WritePDTable prints the rows of RunPD: the figures, then where the P/D time goes.
func WritePDTable(w io.Writer, rows []PDRow) error {
	measured := make([]PDRow, 0, len(rows))
	for _, r := range rows {
		if r.Unsupported == "" {
			measured = append(measured, r)
		}
	}
	ceiling := "one goroutine's memcpy of as many bytes, this run"
	if len(measured) > 0 {
		where := "in one process"
		if measured[0].Hosts {
			where = "single engine, P and D on hosts of their own (network namespaces), the proxy on the client's"
			ceiling = "raw TCP streams of as many bytes from P's host to D's (requests, then the bytes, over warm connections), this run:\n" +
				"the better of one connection and four (as many as the transfer engine opens): " + tcpCeilings(measured)
		}
		fmt.Fprintf(w, "kvbridge bench pd: backend %s, %s, P TP %d → D TP %d (single engine TP 1); medians of %d requests per path after one warm-up; TTFT = non-stream max_tokens=1 answer\n",
			measured[0].Backend, where, measured[0].PrefillTP, measured[0].DecodeTP, measured[0].Iters)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "transfer_mode\tprompt_len\tttft_single_ms\tttft_pd_ms\toverhead\tpaired\ttransfer_ms\ttransfer_share\thidden_share\ttransfer_gbps\tceiling_gbps\tratio\t")
	for _, r := range measured {
		hidden := "n/a"
		if r.HiddenShare >= 0 {
			hidden = fmt.Sprintf("%.0f%%", 100*r.HiddenShare)
		}
		fmt.Fprintf(tw, "%s\t%d\t%.1f\t%.1f\t%+.1f%%\t%+.1f%%\t%.2f\t%.2f%%\t%s\t%.2f\t%.2f\t%.2f\t\n",
			r.Mode, r.PromptLen, r.TTFTSingleMs, r.TTFTPDMs, 100*r.Overhead, 100*r.OverheadPaired, r.TransferMs, 100*r.TransferShare, hidden,
			r.TransferGBps, r.CeilingGBps, r.Ratio)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, r := range rows {
		if r.Unsupported != "" {
			fmt.Fprintf(w, "%s: unsupported by engines: %s\n", r.Mode, r.Unsupported)
		}
	}
	fmt.Fprintln(w, "\nwhere the P/D TTFT goes (ms, medians; legs as the proxy's transport saw them, engine times from each engine's TTFT histogram):")
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "transfer_mode\tprompt_len\tadded\tadded_share\tproxy_in\tp_leg\tproxy_mid\td_leg\td_http\td_engine\td_transfer\trecompute_1tok\t(packing)\td_sched\tproxy_out\tsingle_engine\tp_engine\tsingle_cpu\tp_cpu\td_cpu\t")
	for _, r := range measured {
		cpu := func(ms float64) string {
			if ms < 0 {
				return "n/a"
			}
			return fmt.Sprintf("%.1f", ms)
		}
		fmt.Fprintf(tw, "%s\t%d\t%.1f\t%.1f%%\t%.2f\t%.1f\t%.2f\t%.1f\t%.1f\t%.1f\t%.2f\t%.1f\t%.1f\t%.1f\t%.2f\t%.1f\t%.1f\t%s\t%s\t%s\t\n",
			r.Mode, r.PromptLen, r.AddedMs, 100*r.AddedShare, r.ProxyInMs, r.PLegMs, r.ProxyMidMs, r.DLegMs, r.DHTTPMs, r.DEngineMs,
			r.TransferMs, r.RecomputeMs, r.RecomputeMs-r.RecomputeWarmMs, r.DSchedMs, r.ProxyOutMs, r.SingleEngineMs, r.PEngineMs,
			cpu(r.SingleCPUMs), cpu(r.PCPUMs), cpu(r.DCPUMs))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintln(w, "overhead = ttft_pd ÷ ttft_single − 1 (of the two medians); paired = the median over the requests of the same ratio, each P/D request\n"+
		"with the single-engine request sent beside it (the two alternate), so that drift hitting both alike cancels\n"+
		"transfer = the KV transfer (NIXL xferDuration): D's read (pull), P's writes (push); ceiling = "+ceiling+";\n"+
		"hidden_share = the transfer time spent before P had answered: 0 when D's leg left after P's answer (pull); with the legs overlapping (push,\n"+
		"proxy_mid < 0) 1 − (d_end − p_end − recompute_1tok, within [0, transfer]) ÷ transfer, a lower bound (HTTP after P's answer counts as exposed); n/a: no P answer traced\n"+
		"push-layered sets kv_connector_extra_config.push_layerwise on P\nratio = the median over the requests of the transfer's GB/s ÷ the ceiling's, measured right after it\n"+
		"added = ttft_pd − p_leg in the same request (proxy hops + D's leg); added_share = added ÷ p_leg: the P/D overhead free of request-to-request noise\n"+
		"d_http = d_leg − d_engine; recompute_1tok = D's one-token step over the prompt on fresh blocks, timed alone\n"+
		"(0 when D started from P's first token: push with P's and D's sampling alike, D computed nothing),\n"+
		"(packing) = its part spent packing the context's KV for attention (cold − warm step); d_sched = d_engine − d_transfer − recompute_1tok\n"+
		"single_cpu, p_cpu, d_cpu = CPU time of the single engine's process during its request, of P's and D's during the P/D request (--hosts;\n"+
		"n/a in one process): the hosts share the machine's cores, so P and D's CPU beyond the single engine's is time P's prefill may lose")
	return err
}

// tcpCeilings lists the rows' raw TCP streams, one connection and four.
func tcpCeilings(rows []PDRow) string {
	parts := make([]string, len(rows))
	for i, r := range rows {
		parts[i] = fmt.Sprintf("%d: %.2f/%.2f GB/s", r.PromptLen, r.TCP1ConnGBps, r.TCP4ConnGBps)
	}
	return strings.Join(parts, ", ")
}

// WriteProxyTable prints the rows of RunProxy.
func WriteProxyTable(w io.Writer, rows []ProxyRow) error {
	if len(rows) > 0 {
		fmt.Fprintf(w, "kvbridge bench proxy: %s, %d-token prompts, non-stream, closed loop for %s per way in %d alternating rounds; direct = the benchmark makes the P and D legs itself\n",
			rows[0].Model, rows[0].PromptLen, rows[0].Duration, rows[0].Rounds)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "clients\tmax_tokens\tdirect_rps\tproxy_rps\tratio\tdirect_p50_ms\tproxy_p50_ms\tadded_p50_ms\tdirect_p99_ms\tproxy_p99_ms\tadded_p99_ms\tdirect_cpu_µs/req\tproxy_cpu_µs/req\tadded_cpu_µs\t")
	for _, r := range rows {
		fmt.Fprintf(tw, "%d\t%d\t%.0f\t%.0f\t%.2f\t%.2f\t%.2f\t%+.2f\t%.2f\t%.2f\t%+.2f\t%.0f\t%.0f\t%+.0f\t\n",
			r.Clients, r.MaxTokens, r.DirectRPS, r.ProxyRPS, r.RPSRatio, r.DirectP50Ms, r.ProxyP50Ms, r.AddedP50Ms,
			r.DirectP99Ms, r.ProxyP99Ms, r.AddedP99Ms, r.DirectCPUUs, r.ProxyCPUUs, r.AddedCPUUs)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintln(w, "ratio = proxy_rps ÷ direct_rps (the direct legs are the ceiling); added = proxy latency − direct latency at that percentile\n"+
		"cpu = this process's CPU time per request (clients, proxy and both engines share it); added_cpu = what the proxy hop costs per request")
	return err
}

// WriteJSON writes rows to path as an indented JSON array.
func WriteJSON[R PDRow | ProxyRow](path string, rows []R) error {
	b, err := json.MarshalIndent(rows, "", "  ")
	if err != nil {
		return fmt.Errorf("pdbench: %w", err)
	}
	if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("pdbench: %w", err)
	}
	return nil
}
