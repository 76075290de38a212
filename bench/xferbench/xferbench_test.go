package xferbench

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

const envPeer = "KVBRIDGE_XFERBENCH_TEST_PEER"

func TestMain(m *testing.M) {
	if os.Getenv(envPeer) != "" {
		if err := RunPeer(context.Background(), os.Stdin, os.Stdout); err != nil {
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// testPeerCommand re-executes the test binary as the benchmark's peer.
func testPeerCommand(ctx context.Context) *exec.Cmd {
	c := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
	c.Env = append(os.Environ(), envPeer+"=1")
	c.Stderr = os.Stderr
	return c
}

// TestRunSmall runs a tiny matrix end to end (peer process, both backends, both ops, data
// check) and checks the table and the JSON fields. It asserts no timing.
func TestRunSmall(t *testing.T) {
	ctx := t.Context()
	rows, err := Run(ctx, Options{
		Blocks:      []int64{4 << 10, 64 << 10},
		Batches:     []int{1, 8},
		Iters:       3,
		Warmup:      1,
		Notify:      true,
		PeerCommand: testPeerCommand,
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 2*2*2*2 {
		t.Fatalf("%d rows", len(rows))
	}
	for _, r := range rows {
		if r.GBps <= 0 || r.CeilingGBps <= 0 || r.Ratio <= 0 || (r.Backend != "SHM" && r.Backend != "TCP") {
			t.Fatalf("row %+v", r)
		}
		if (r.Backend == "SHM") != (r.Ceiling == "memcpy") {
			t.Fatalf("row %+v has the wrong ceiling", r)
		}
	}
	var buf bytes.Buffer
	if err := WriteTable(&buf, rows); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(buf.String(), "ratio") || strings.Count(buf.String(), "\n") != len(rows)+1 {
		t.Fatalf("table:\n%s", buf.String())
	}
	path := filepath.Join(t.TempDir(), "rows.json")
	if err := WriteJSON(path, rows); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var generic []map[string]any
	if err := json.Unmarshal(b, &generic); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"backend", "op", "block_bytes", "batch", "gbps", "ceiling_gbps", "ratio"} {
		if _, ok := generic[0][f]; !ok {
			t.Fatalf("JSON row lacks %q: %v", f, generic[0])
		}
	}
}

// TestOptions rejects bad matrices before starting anything.
func TestOptions(t *testing.T) {
	noPeer := func(context.Context) *exec.Cmd { t.Fatal("peer started"); return nil }
	for _, o := range []Options{
		{Backends: []string{"LIBFABRIC"}, PeerCommand: noPeer},
		{Blocks: []int64{12}, PeerCommand: noPeer},
		{Batches: []int{0}, PeerCommand: noPeer},
		{Blocks: []int64{1 << 20}, Batches: []int{1024}, MaxBytes: 1 << 20, PeerCommand: noPeer},
		{},
	} {
		if _, err := Run(t.Context(), o); err == nil {
			t.Fatalf("%+v accepted", o)
		}
	}
}
