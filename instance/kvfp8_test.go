package instance_test

import (
	"fmt"
	"log/slog"
	"net/http"
	"testing"

	"github.com/kvbridge/kvbridge/apiclient"
	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/internal/fixture"
	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/stack"
)

// complete asks url for a greedy completion of prompt i and returns the response's text, or
// the error the client saw.
func complete(t *testing.T, url, modelName string, i int) (string, error) {
	t.Helper()
	body := map[string]any{"model": modelName, "prompt": fmt.Sprintf("Prompt %d is long enough to fill more than one block of sixteen tokens.", i),
		"max_tokens": 6, "temperature": 0, "ignore_eos": true}
	r, err := apiclient.Post(t.Context(), &http.Client{}, url+"/v1/completions", body, nil)
	if err == nil {
		err = r.Check(url)
	}
	if err != nil {
		return "", err
	}
	return r.Text, nil
}

// TestKVCacheFP8PD: P and D serve a bf16 checkpoint with --kv-cache-dtype fp8, so both hold
// one-byte FP8 E4M3 KV (half a bfloat16 block: half the bytes in the pool and on the wire, which
// moves whole blocks) and agree at the handshake; answers through the proxy are a single fp8
// engine's, with D pulling P's blocks.
func TestKVCacheFP8PD(t *testing.T) {
	m, err := model.Open(t.Context(), smallCheckpoint(t, "BF16", nil), model.OpenOptions{KVCacheDType: "fp8"})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if m.KVCacheDType() != "fp8_e4m3" {
		t.Fatalf("fp8: KV cache %s, want fp8_e4m3", m.KVCacheDType())
	}
	s, err := stack.Start(t.Context(), stack.Config{Model: m, Single: true, NumBlocks: 64})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		s.Close()
		if err := s.CheckPools(); err != nil {
			t.Error(err)
		}
	}()
	for i := range 3 {
		got, err := complete(t, s.URL, m.Name(), i)
		if err != nil {
			t.Fatal(err)
		}
		want, err := complete(t, s.Single.URL(), m.Name(), i)
		if err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Errorf("prompt %d: P/D %q, single fp8 engine %q", i, got, want)
		}
	}
	for _, e := range []*stack.Engine{s.P, s.D} {
		// One layer × K,V × one KV head × 32 channels × 16 slots × 1 byte.
		if g := e.Instance().Pool.Geometry(); g.DType != kvcache.FP8E4M3 || g.BlockBytes() != 2*32*g.BlockSize {
			t.Errorf("%s: KV cache %v with %d bytes a block, want fp8_e4m3 with %d", e.Name, g.DType, g.BlockBytes(), 2*32*g.BlockSize)
		}
	}
	if hits := s.D.Instance().Ranks[0].Engine.Stats().ExternalHits; hits == 0 {
		t.Error("D pulled no KV from P")
	}
}

// TestKVCacheDTypeMismatchNamesBoth: an fp8 P and a bfloat16 D refuse each other at the
// handshake (the compatibility hash covers the KV dtype), the request fails rather than decode
// bytes of another type, and D's log names both dtypes.
func TestKVCacheDTypeMismatchNamesBoth(t *testing.T) {
	start := func(role connector.Role, dtype string, logs *fixture.LogBuffer) *stack.Engine {
		e, err := stack.StartEngine(t.Context(), stack.EngineConfig{Name: string(role), ModelName: model.Tiny, Role: role, KVCacheDType: dtype,
			NumBlocks: 64, Logger: slog.New(slog.NewTextHandler(logs, nil))})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			in := e.Instance()
			if err := e.Close(); err != nil {
				t.Errorf("close: %v", err)
			}
			if in.Pool.NumFree() != in.Pool.NumBlocks() {
				t.Errorf("%s: %d of %d blocks free after close", role, in.Pool.NumFree(), in.Pool.NumBlocks())
			}
		})
		return e
	}
	var pLogs, dLogs fixture.LogBuffer
	p := start(connector.RoleProducer, "fp8", &pLogs)
	d := start(connector.RoleConsumer, "bfloat16", &dLogs)
	px, err := stack.StartProxy(stack.ProxyConfig{Prefill: []string{p.FrontAddr()}, Decode: []string{d.FrontAddr()}})
	if err != nil {
		t.Fatal(err)
	}
	defer px.Close()
	if text, err := complete(t, px.URL, model.Tiny, 0); err == nil {
		t.Fatalf("fp8 P, bfloat16 D answered %q; want the load to fail", text)
	}
	if !dLogs.HasLine("compatibility hash mismatch", "fp8_e4m3", "bfloat16") {
		t.Errorf("D's log does not name both KV dtypes:\n%s", dLogs.String())
	}
}
