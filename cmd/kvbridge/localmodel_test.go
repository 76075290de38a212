package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvbridge/kvbridge/internal/procmem"
	"github.com/kvbridge/kvbridge/model"
)

// residentBytes reads VmRSS of process pid.
func residentBytes(t *testing.T, pid int) int64 {
	t.Helper()
	if _, err := os.Stat("/proc/self/status"); err != nil {
		t.Skipf("no /proc on this system: %v", err)
	}
	n, err := procmem.ResidentOf(pid)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestServeLocalCheckpointMemory serves a Qwen3-shaped bf16 checkpoint directory (random weights,
// 8 of Qwen3-0.6B's 28 layers, its real vocabulary) with default flags but a small KV cache, as a
// child process, and checks the memory target: resident memory after load ≤ 1.15 × the
// safetensors bytes + the KV pool. Widening the weights to float32, keeping a tied embedding
// twice, or keeping the pages of an untied embedding's mapped checkpoint after packing the rest
// would take up to twice that.
func TestServeLocalCheckpointMemory(t *testing.T) {
	if testing.Short() {
		t.Skip("writes a 500 MB checkpoint")
	}
	for _, tied := range []bool{true, false} {
		t.Run(map[bool]string{true: "tied", false: "untied"}[tied], func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "Qwen3-shaped")
			cfg := model.Qwen3_0_6B()
			cfg.NumLayers, cfg.TieWordEmbeddings = 8, tied
			st, err := model.WriteRandomCheckpoint(dir, model.RandomCheckpoint{Config: cfg})
			if err != nil {
				t.Fatal(err)
			}
			const kvBytes = 64 << 20
			p := startProcess(t, nil, "serve", dir, "--port", "0", "--kv-cache-memory-bytes", fmt.Sprint(kvBytes), "--served-model-name", "qwen3-local")
			rss := residentBytes(t, p.cmd.Process.Pid)
			limit := int64(1.15*float64(st)) + kvBytes
			t.Logf("resident %.1f MB, safetensors %.1f MB, KV pool %.1f MB: %.2f of the limit %.1f MB",
				float64(rss)/1e6, float64(st)/1e6, float64(kvBytes)/1e6, float64(rss)/float64(limit), float64(limit)/1e6)
			if rss > limit {
				t.Fatalf("resident memory %d bytes exceeds 1.15 × %d safetensors bytes + %d KV bytes = %d", rss, st, kvBytes, limit)
			}
			// The model answers under its served name; its context (40960) was shortened to the pool.
			if !p.waitLog(t, "model_context=40960") {
				t.Fatalf("the shortened context is not logged:\n%s", p.log())
			}
			code, body := postJSON(t, p.url+"/v1/completions", map[string]any{"model": "qwen3-local", "prompt": "Hello", "max_tokens": 3, "ignore_eos": true})
			if code != http.StatusOK {
				t.Fatalf("completion: %d %s", code, body)
			}
		})
	}
}

// TestServeRepoIDFromHubCache serves ORG/NAME from a Hugging Face cache under $HF_HOME at a
// tagged revision, as `kvbridge serve ORG/NAME --revision TAG` in the README.
func TestServeRepoIDFromHubCache(t *testing.T) {
	home := t.TempDir()
	repo := filepath.Join(home, "hub", "models--acme--qwen3-mini")
	cfg := model.Qwen3_0_6B()
	cfg.NumLayers, cfg.HiddenSize, cfg.IntermediateSize, cfg.NumHeads, cfg.NumKVHeads, cfg.HeadDim, cfg.VocabSize = 1, 64, 128, 2, 1, 32, 4096
	if _, err := model.WriteRandomCheckpoint(filepath.Join(repo, "snapshots", "0123abcd"), model.RandomCheckpoint{Config: cfg}); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(repo, "refs"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(repo, "refs", "v1"), []byte("0123abcd"), 0o644); err != nil {
		t.Fatal(err)
	}
	env := []string{"HF_HOME=" + home, "HF_HUB_CACHE=", "HUGGINGFACE_HUB_CACHE="}
	p := startProcess(t, env, "serve", "acme/qwen3-mini", "--revision", "v1", "--port", "0")
	resp, err := http.Get(p.url + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var models struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&models); err != nil || len(models.Data) != 1 || models.Data[0].ID != "acme/qwen3-mini" {
		t.Fatalf("/v1/models: %v %+v", err, models)
	}
}

// TestServeSizingFlagErrors: bad sizing and precision flags are usage errors (exit status 2)
// naming the flag.
func TestServeSizingFlagErrors(t *testing.T) {
	for _, tc := range []struct {
		env  string
		args []string
		want string
	}{
		{"", []string{"--gpu-memory-utilization", "1.5"}, "--gpu-memory-utilization"},
		{"", []string{"--gpu-memory-utilization", "0.5", "--kv-cache-memory-bytes", "1G"}, "give one"},
		{"VLLM_CPU_KVCACHE_SPACE=lots", nil, "VLLM_CPU_KVCACHE_SPACE"},
		// Infinite, or beyond int64 bytes (1e10 GiB ≈ 1.07e19 > 2^63 ≈ 9.22e18): no overflow.
		{"VLLM_CPU_KVCACHE_SPACE=inf", nil, "VLLM_CPU_KVCACHE_SPACE"},
		{"VLLM_CPU_KVCACHE_SPACE=1e10", nil, "VLLM_CPU_KVCACHE_SPACE"},
		{"VLLM_CPU_KVCACHE_SPACE=8589934592", nil, "VLLM_CPU_KVCACHE_SPACE"}, // 2^33 GiB = 2^63 bytes
		{"VLLM_CPU_KVCACHE_SPACE=NaN", nil, "VLLM_CPU_KVCACHE_SPACE"},
		{"", []string{"--dtype", "half"}, "--dtype"},
		{"", []string{"--kv-cache-dtype", "fp8_inc"}, "--kv-cache-dtype"},
		{"", []string{"--kv-cache-dtype", "fp8", "--calculate-kv-scales"}, "--calculate-kv-scales"},
	} {
		args := append([]string{"serve", "kvbridge/tiny", "--port", "0"}, tc.args...)
		cmd := exec.Command(os.Args[0], args...)
		cmd.Env = append(os.Environ(), "KVBRIDGE_TEST_MAIN=1", tc.env)
		out, err := cmd.CombinedOutput()
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.ExitCode() != 2 || !strings.Contains(string(out), tc.want) {
			t.Errorf("%v %s: err %v, output %q; want exit status 2 naming %s", tc.args, tc.env, err, out, tc.want)
		}
	}
}
