package pdbench

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// readJSONRows reads a --json file back as generic rows.
func readJSONRows(t *testing.T, path string) []map[string]any {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var rows []map[string]any
	if err := json.Unmarshal(b, &rows); err != nil {
		t.Fatalf("%s does not parse: %v\n%s", path, err, b)
	}
	return rows
}

// TestRunPDTiny runs every transfer mode (pull, push, push layer by layer) and measures each:
// the transfer moved bytes and its hidden share is a fraction.
func TestRunPDTiny(t *testing.T) {
	rows, err := RunPD(t.Context(), PDOptions{Model: "kvbridge/tiny", PromptLens: []int{40}, Iters: 1,
		TransferModes: []string{TransferPull, TransferPush, TransferPushLayered}})
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 3 {
		t.Fatalf("%d rows, want 3", len(rows))
	}
	for i, mode := range []string{TransferPull, TransferPush, TransferPushLayered} {
		r := rows[i]
		switch {
		case r.Mode != mode:
			t.Errorf("row %d is %q, want %q", i, r.Mode, mode)
		case r.Unsupported != "":
			t.Errorf("%s unsupported: %s", mode, r.Unsupported)
		case r.PromptLen != 40 || r.TransferBytes <= 0 || r.HiddenShare > 1:
			t.Errorf("%s row %+v", mode, r)
		case mode != TransferPull && r.RecomputeMs != 0:
			t.Errorf("%s: recompute_ms %v, want 0 (D starts from P's first token)", mode, r.RecomputeMs)
		}
	}
	var modes bytes.Buffer
	if err := WritePDTable(&modes, rows); err != nil {
		t.Fatal(err)
	}
	for _, r := range rows[1:] {
		if r.Unsupported != "" && !strings.Contains(modes.String(), r.Mode+": unsupported by engines: ") {
			t.Errorf("table does not say %s is unsupported:\n%s", r.Mode, modes.String())
		}
	}
	rows = rows[:1]
	r := rows[0]
	if r.PromptLen != 40 || r.Backend != "SHM" || r.TransferBytes <= 0 || r.HiddenShare != 0 { // pull is serial: it hides nothing
		t.Errorf("row %+v", r)
	}
	for name, v := range map[string]float64{
		"ttft_single_ms": r.TTFTSingleMs, "ttft_pd_ms": r.TTFTPDMs, "transfer_ms": r.TransferMs,
		"transfer_share": r.TransferShare, "transfer_gbps": r.TransferGBps, "ceiling_gbps": r.CeilingGBps,
		"ratio": r.Ratio, "p_leg_ms": r.PLegMs, "d_leg_ms": r.DLegMs, "recompute_ms": r.RecomputeMs,
	} {
		if !(v > 0) {
			t.Errorf("%s = %v, want > 0", name, v)
		}
	}
	var table bytes.Buffer
	if err := WritePDTable(&table, rows); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"transfer_mode", "ttft_single_ms", "paired", "transfer_share", "hidden_share", "ceiling_gbps", "where the P/D TTFT goes"} {
		if !strings.Contains(table.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, table.String())
		}
	}
	path := filepath.Join(t.TempDir(), "pd.json")
	if err := WriteJSON(path, rows); err != nil {
		t.Fatal(err)
	}
	got := readJSONRows(t, path)
	if len(got) != 1 {
		t.Fatalf("%d JSON rows, want 1", len(got))
	}
	for _, k := range []string{"ttft_single_ms", "ttft_pd_ms", "transfer_ms", "transfer_share", "transfer_gbps", "ceiling_gbps", "ratio"} {
		if v, ok := got[0][k].(float64); !ok || v <= 0 {
			t.Errorf("json %s = %v", k, got[0][k])
		}
	}
	for _, k := range []string{"overhead", "overhead_paired"} {
		if _, ok := got[0][k].(float64); !ok {
			t.Errorf("json %s = %v", k, got[0][k])
		}
	}
}

func TestRunProxyTiny(t *testing.T) {
	rows, err := RunProxy(t.Context(), ProxyOptions{Clients: []int{2}, MaxTokens: []int{2}, Duration: 100 * time.Millisecond, Warmup: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 1 || rows[0].Clients != 2 || rows[0].MaxTokens != 2 {
		t.Fatalf("rows %+v", rows)
	}
	r := rows[0]
	for name, v := range map[string]float64{
		"direct_rps": r.DirectRPS, "proxy_rps": r.ProxyRPS, "rps_ratio": r.RPSRatio,
		"direct_p50_ms": r.DirectP50Ms, "direct_p99_ms": r.DirectP99Ms, "proxy_p50_ms": r.ProxyP50Ms, "proxy_p99_ms": r.ProxyP99Ms,
	} {
		if !(v > 0) {
			t.Errorf("%s = %v, want > 0", name, v)
		}
	}
	if r.DirectRequests <= 0 || r.ProxyRequests <= 0 || r.DirectP99Ms < r.DirectP50Ms || r.ProxyP99Ms < r.ProxyP50Ms {
		t.Errorf("row %+v", r)
	}
	var table bytes.Buffer
	if err := WriteProxyTable(&table, rows); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(table.String(), "added_p50_ms") {
		t.Errorf("table lacks added_p50_ms:\n%s", table.String())
	}
	path := filepath.Join(t.TempDir(), "proxy.json")
	if err := WriteJSON(path, rows); err != nil {
		t.Fatal(err)
	}
	got := readJSONRows(t, path)
	if len(got) != 1 {
		t.Fatalf("%d JSON rows, want 1", len(got))
	}
	for _, k := range []string{"direct_rps", "proxy_rps", "direct_p50_ms", "proxy_p50_ms", "direct_p99_ms", "proxy_p99_ms"} {
		if v, ok := got[0][k].(float64); !ok || v <= 0 {
			t.Errorf("json %s = %v", k, got[0][k])
		}
	}
	for _, k := range []string{"added_p50_ms", "added_p99_ms", "direct_cpu_us_per_req", "proxy_cpu_us_per_req", "added_cpu_us_per_req"} {
		if _, ok := got[0][k].(float64); !ok {
			t.Errorf("json %s = %v", k, got[0][k])
		}
	}
}

func TestOptionsRejectBadValues(t *testing.T) {
	if _, err := RunPD(t.Context(), PDOptions{Model: "kvbridge/tiny", PromptLens: []int{32}, Backend: "UCX"}); err == nil {
		t.Error("RunPD accepted backend UCX")
	}
	if _, err := RunProxy(t.Context(), ProxyOptions{Clients: []int{0}}); err == nil {
		t.Error("RunProxy accepted 0 clients")
	}
}

// TestTaskCPUMatchesRusage: the per-thread scheduler times taskCPU sums for a process move as
// the kernel's own account of the process (getrusage) does, over the same spell of work.
func TestTaskCPUMatchesRusage(t *testing.T) {
	t0, err := taskCPU(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	r0 := processCPU()
	x := 1.0
	for processCPU()-r0 < 200*time.Millisecond {
		for range 100000 {
			x = x*1.0000001 + 1e-9
		}
	}
	t1, err := taskCPU(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	r1 := processCPU()
	if got, want := t1-t0, r1-r0; got < want*8/10 || got > want*12/10+10*time.Millisecond {
		t.Errorf("taskCPU moved %v, getrusage %v (x %v)", got, want, x)
	}
}
