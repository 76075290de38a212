package soak

import (
	"encoding/json"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
)

// TestShortSoak runs the soak for 5 s with a fault every 250 ms on average: every answer must
// be right, every block free and the process flat once the stack quiesced, and the JSON report
// must carry the documented keys.
func TestShortSoak(t *testing.T) {
	before := runtime.NumGoroutine()
	var progress strings.Builder
	rep, err := Run(t.Context(), Config{Duration: 5 * time.Second, Seed: 1, Concurrency: 3, FaultInterval: 250 * time.Millisecond,
		Progress: &progress, ProgressEvery: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	var text strings.Builder
	if err := rep.WriteText(&text); err != nil {
		t.Fatal(err)
	}
	t.Log("\n" + text.String())
	if rep.Requests == 0 || rep.Served == 0 {
		t.Fatal("nothing was served")
	}
	var faults int64
	for _, n := range rep.Faults {
		faults += n
	}
	if faults == 0 {
		t.Error("no fault was injected")
	}
	if rep.WrongOutputs != 0 {
		t.Errorf("%d wrong outputs", rep.WrongOutputs)
	}
	if rep.LeakedBlocks != 0 || !rep.Flat || !rep.Pass {
		t.Errorf("leaked blocks %d, flat %v, pass %v: %v", rep.LeakedBlocks, rep.Flat, rep.Pass, rep.Failures)
	}
	if !strings.Contains(progress.String(), "soak ") {
		t.Errorf("no progress line: %q", progress.String())
	}

	path := filepath.Join(t.TempDir(), "soak.json")
	if err := rep.WriteJSON(path); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(data, &m); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"requests", "wrong_outputs", "leaked_blocks", "errors_by_class"} {
		if _, ok := m[k]; !ok {
			t.Errorf("the JSON report has no %q", k)
		}
	}

	// Run closed everything it started.
	deadline := time.Now().Add(10 * time.Second)
	for runtime.NumGoroutine() > before {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			t.Fatalf("%d goroutines after Run, %d before:\n%s", runtime.NumGoroutine(), before, buf[:runtime.Stack(buf, true)])
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestConfigErrors(t *testing.T) {
	for _, cfg := range []Config{{Policy: "retry"}, {Faults: []string{"meteor"}}} {
		if _, err := Run(t.Context(), cfg); err == nil {
			t.Errorf("%+v: no error", cfg)
		}
	}
}
