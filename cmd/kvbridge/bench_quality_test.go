package main

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestBenchQuality runs `kvbridge bench quality` tiny: the table has the int8 row and the
// simulated Q8_0 baseline, and the JSON file their figures; bad flags exit with status 2
// naming the flag, before anything is loaded.
func TestBenchQuality(t *testing.T) {
	path := filepath.Join(t.TempDir(), "q.json")
	cmd := exec.Command(os.Args[0], "bench", "quality", "--model", "kvbridge/tiny", "--prompts", "3", "--positions", "4", "--json", path)
	cmd.Env = append(os.Environ(), "KVBRIDGE_TEST_MAIN=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	for _, want := range []string{"--dtype float32 --quantization int8", "Q8_0 (simulated llama.cpp)", "mean KL"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	var r struct {
		Rows []struct {
			Quantization string  `json:"quantization"`
			MeanKL       float64 `json:"mean_kl"`
			Top1         float64 `json:"top1"`
		} `json:"rows"`
	}
	b, err := os.ReadFile(path)
	if err != nil || json.Unmarshal(b, &r) != nil || len(r.Rows) != 2 || r.Rows[0].Quantization != "int8" || r.Rows[0].MeanKL <= 0 || r.Rows[0].Top1 <= 0 {
		t.Fatalf("json %v: %s", err, b)
	}
	for _, c := range []struct{ flag, value string }{{"--quantization", "awq"}, {"--dtype", "half"}, {"--kv-cache-dtype", "int4"}, {"--prompts", "0"}} {
		cmd := exec.Command(os.Args[0], "bench", "quality", "--model", "kvbridge/tiny", c.flag, c.value)
		cmd.Env = append(os.Environ(), "KVBRIDGE_TEST_MAIN=1")
		out, err := cmd.CombinedOutput()
		ee, ok := err.(*exec.ExitError)
		if !ok || ee.ExitCode() != 2 || !strings.Contains(string(out), c.flag) || strings.Contains(string(out), "loading") {
			t.Errorf("%s %s: %v, output %q; want exit status 2 naming the flag", c.flag, c.value, err, out)
		}
	}
}
