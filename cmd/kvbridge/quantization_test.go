package main

import (
	"encoding/json"
	"strings"
	"testing"
)

// TestCrossProcessPDInt8: with --quantization int8 on every engine, P/D gives the single int8
// engine's tokens and logprobs bit for bit; a decoder without it refuses the int8 producer's
// KV at the handshake (the compatibility hash covers the quantization) and says why.
func TestCrossProcessPDInt8(t *testing.T) {
	int8Args := serveArgs("--quantization", "int8")
	single := startProcess(t, nil, int8Args...)
	if !single.waitLog(t, "quantization=int8") {
		t.Fatalf("the int8 engine does not log its quantization:\n%s", single.log())
	}
	prompts := []any{"Hi", strings.Repeat("many words make many blocks ", 30), []int{5, 6, 7}}
	request := func(p any) map[string]any {
		return map[string]any{"model": "kvbridge/tiny", "prompt": p, "max_tokens": 12, "temperature": 0, "logprobs": 3}
	}
	want := make([]string, len(prompts))
	for i, p := range prompts {
		status, raw := postJSON(t, single.url+"/v1/completions", request(p))
		if status != 200 {
			t.Fatalf("single: %d %s", status, raw)
		}
		want[i] = choice(t, raw)
	}
	role := func(r string, args []string) []string {
		return append(append([]string(nil), args...), "--kv-transfer-config.kv_connector", "NixlConnector", "--kv-transfer-config.kv_role", r)
	}
	p := startProcess(t, sideChannel, role("kv_producer", int8Args)...)
	d := startProcess(t, sideChannel, role("kv_consumer", int8Args)...)
	proxy := func(d *process) *process {
		return startProcess(t, nil, "proxy", "--port", "0", "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", port(t, p.url),
			"--decoder-hosts", "127.0.0.1", "--decoder-ports", port(t, d.url))
	}
	px := proxy(d)
	for i, prompt := range prompts {
		status, raw := postJSON(t, px.url+"/v1/completions", request(prompt))
		if status != 200 {
			t.Fatalf("proxy: %d %s\nP: %s\nD: %s", status, raw, p.log(), d.log())
		}
		if got := choice(t, raw); got != want[i] {
			t.Errorf("prompt %d: P/D %s\nsingle %s", i, got, want[i])
		}
	}

	plain := startProcess(t, sideChannel, role("kv_consumer", serveArgs())...)
	status, raw := postJSON(t, proxy(plain).url+"/v1/completions", request("Hi"))
	if status == 200 {
		t.Fatalf("an unquantized decoder took an int8 producer's KV: %s", raw)
	}
	if !plain.waitLog(t, "NIXL compatibility hash mismatch") || !strings.Contains(plain.log(), "--quantization") {
		t.Errorf("the decoder does not log the mismatch naming --quantization:\n%s", plain.log())
	}
}

// choice returns the text and logprobs of a completion's first choice, as JSON.
func choice(t *testing.T, raw []byte) string {
	t.Helper()
	var r struct {
		Choices []struct {
			Text     string          `json:"text"`
			Logprobs json.RawMessage `json:"logprobs"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(raw, &r); err != nil || len(r.Choices) != 1 || len(r.Choices[0].Logprobs) < 10 {
		t.Fatalf("completion %s: %v", raw, err)
	}
	b, _ := json.Marshal(r.Choices[0])
	return string(b)
}
