package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
)

// TestCrossProcessPush runs push mode as separate `kvbridge serve` processes started with
// --kv-transfer-config.kv_connector NixlPushConnector, over SHM and TCP: the serial flow (vLLM's
// toy push proxy: D gets P's coordinates after P answered) and both legs at once (D's leg
// addressed from P's GET /v1/kv_transfer, the same push_id on both); every answer is a single
// engine's.
func TestCrossProcessPush(t *testing.T) {
	single := startProcess(t, nil, serveArgs()...)
	prompts := []any{"Hi", "The KV cache of this prompt is computed on one process and written into another.",
		strings.Repeat("many words make many blocks ", 30), []int{5, 6, 7}}
	want := make([]string, len(prompts))
	for i, p := range prompts {
		status, raw := postJSON(t, single.url+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": p, "max_tokens": 12, "temperature": 0})
		if status != 200 {
			t.Fatalf("single: %d %s", status, raw)
		}
		want[i] = completionText(t, raw)
	}
	for _, backend := range []string{"SHM", "TCP"} {
		t.Run(backend, func(t *testing.T) {
			cfg := func(role string) []string {
				return serveArgs("--kv-transfer-config.kv_connector", "NixlPushConnector", "--kv-transfer-config.kv_role", role,
					"--kv-transfer-config.kv_connector_extra_config.backends+", backend)
			}
			p := startProcess(t, sideChannel, cfg("kv_producer")...)
			d := startProcess(t, sideChannel, append(cfg("kv_consumer"), "--enable-prompt-tokens-details")...)
			info := kvTransferInfo(t, p.url)
			if info["transfer_mode"] != "push" || info["kv_connector"] != "NixlPushConnector" {
				t.Fatalf("P reports %v", info)
			}
			for i, prompt := range prompts {
				// Serially.
				status, raw := postJSON(t, p.url+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
					"kv_transfer_params": map[string]any{"do_remote_decode": true, "do_remote_prefill": false}})
				var pr struct {
					KV map[string]any `json:"kv_transfer_params"`
				}
				if err := json.Unmarshal(raw, &pr); status != 200 || err != nil || pr.KV["transfer_mode"] != "push" {
					t.Fatalf("prefill: %d %s", status, raw)
				}
				dkv := map[string]any{"do_remote_prefill": true, "do_remote_decode": false}
				for _, k := range []string{"remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size"} {
					dkv[k] = pr.KV[k]
				}
				decodeLeg(t, d, p, prompt, dkv, want[i])
				// Both legs at once.
				id := fmt.Sprintf("%s-%d", backend, i)
				var wg sync.WaitGroup
				wg.Go(func() {
					if status, raw := postJSON(t, p.url+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
						"kv_transfer_params": map[string]any{"do_remote_decode": true, "do_remote_prefill": false, "push_id": id}}); status != 200 {
						t.Errorf("prefill leg: %d %s", status, raw)
					}
				})
				decodeLeg(t, d, p, prompt, map[string]any{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": info["engine_id"],
					"remote_host": info["remote_host"], "remote_port": info["remote_port"], "tp_size": info["tp_size"], "push_id": id}, want[i])
				wg.Wait()
			}
			if !d.waitLog(t, "backend="+backend) {
				t.Errorf("D did not report the %s backend:\n%s", backend, d.log())
			}
		})
	}
}

// decodeLeg sends D its leg and checks the answer, and that D started from P's first token: the
// whole prompt came from P or D's prefix cache (P sampled greedily too), D computed none of it.
func decodeLeg(t *testing.T, d, p *process, prompt any, kv map[string]any, want string) {
	t.Helper()
	status, raw := postJSON(t, d.url+"/v1/completions", map[string]any{"model": "kvbridge/tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "kv_transfer_params": kv})
	if status != 200 {
		t.Fatalf("decode: %d %s\nP: %s\nD: %s", status, raw, p.log(), d.log())
	}
	if got := completionText(t, raw); got != want {
		t.Errorf("prompt %v: push P/D %q, single %q", prompt, got, want)
	}
	var r struct {
		Usage struct {
			PromptTokens int `json:"prompt_tokens"`
			Details      struct {
				Cached int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(raw, &r); err != nil || r.Usage.Details.Cached != r.Usage.PromptTokens {
		t.Errorf("prompt %v: %d of %d prompt tokens came from P or D's cache, want all (D starts from P's first token): %s", prompt, r.Usage.Details.Cached, r.Usage.PromptTokens, raw)
	}
}

// kvTransferInfo reads an engine's GET /v1/kv_transfer.
func kvTransferInfo(t *testing.T, url string) map[string]any {
	t.Helper()
	resp, err := http.Get(url + "/v1/kv_transfer")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var info map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&info); err != nil {
		t.Fatal(err)
	}
	return info
}
