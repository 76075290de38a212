package instance_test

import (
	"fmt"
	"log/slog"
	"net/http"
	"path/filepath"
	"testing"

	"github.com/kvbridge/kvbridge/apiclient"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/internal/fixture"
	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/stack"
)

// smallCheckpoint writes a one-layer Qwen3-shaped checkpoint with random weights of dtype
// ("BF16" or "F32") and the RoPE scaling rope (nil: none), and returns its directory.
func smallCheckpoint(t *testing.T, dtype string, rope *model.RopeScaling) string {
	t.Helper()
	cfg := model.Qwen3_0_6B()
	cfg.NumLayers, cfg.HiddenSize, cfg.IntermediateSize, cfg.NumHeads, cfg.NumKVHeads, cfg.HeadDim, cfg.VocabSize = 1, 64, 128, 2, 1, 32, 4096
	cfg.RopeScaling = rope
	dir := filepath.Join(t.TempDir(), "ckpt-"+dtype)
	if _, err := model.WriteRandomCheckpoint(dir, model.RandomCheckpoint{Config: cfg, DType: dtype}); err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestKVCacheDTypeAutoFollowsTheModel: --kv-cache-dtype auto gives the KV cache the model's
// compute dtype, as vLLM does: a bf16 checkpoint served with the defaults stores 2-byte keys and
// values (half the bytes a block, so half the bytes a transfer moves), an f32 checkpoint or
// --dtype float32 keeps float32, and the start-up line says which.
func TestKVCacheDTypeAutoFollowsTheModel(t *testing.T) {
	for _, tc := range []struct {
		ckpt, dtype string
		want        kvcache.DType
	}{
		{"BF16", "auto", kvcache.BFloat16},
		{"F32", "auto", kvcache.Float32},
		{"BF16", "float32", kvcache.Float32},
	} {
		t.Run(tc.ckpt+"/"+tc.dtype, func(t *testing.T) {
			logs := new(fixture.LogBuffer)
			in, err := instance.Start(t.Context(), instance.Config{Model: smallCheckpoint(t, tc.ckpt, nil), Host: "127.0.0.1", NumBlocks: 16,
				DType: tc.dtype, KVCacheDType: "auto", Logger: slog.New(slog.NewTextHandler(logs, nil))})
			if err != nil {
				t.Fatal(err)
			}
			defer func() {
				in.Close()
				if free := in.Pool.NumFree(); free != in.Pool.NumBlocks() {
					t.Errorf("pool has %d of %d blocks free after Close", free, in.Pool.NumBlocks())
				}
			}()
			g := in.Pool.Geometry()
			// One layer × K,V × one KV head × 32 channels × 16 slots × 2 or 4 bytes.
			size := map[kvcache.DType]int{kvcache.BFloat16: 2, kvcache.Float32: 4}[tc.want]
			if g.DType != tc.want || g.BlockBytes() != 2*32*g.BlockSize*size {
				t.Errorf("KV cache %v with %d bytes a block, want %v with %d", g.DType, g.BlockBytes(), tc.want, 2*32*g.BlockSize*size)
			}
			if !logs.HasLine("kv_cache_dtype=" + tc.want.String()) {
				t.Errorf("no start-up line with kv_cache_dtype=%v:\n%s", tc.want, logs)
			}
		})
	}
}

// TestKVCacheDTypeAutoPD: P and D both serve the same bf16 checkpoint with --kv-cache-dtype auto,
// so both hold bfloat16 KV and agree at the handshake; answers through the proxy equal a single
// engine's, with D pulling P's blocks.
func TestKVCacheDTypeAutoPD(t *testing.T) {
	m, err := model.Open(t.Context(), smallCheckpoint(t, "BF16", nil), model.OpenOptions{KVCacheDType: "auto"})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if m.KVCacheDType() != "bfloat16" {
		t.Fatalf("auto on a bf16 checkpoint: KV cache %s, want bfloat16", m.KVCacheDType())
	}
	s, err := stack.Start(t.Context(), stack.Config{Model: m, Single: true, NumBlocks: 64})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		s.Close()
		for _, e := range []*stack.Engine{s.P, s.D, s.Single} {
			if p := e.Instance().Pool; p.NumFree() != p.NumBlocks() {
				t.Errorf("%s: %d of %d blocks free after Close", e.Name, p.NumFree(), p.NumBlocks())
			}
		}
	}()
	hc := &http.Client{}
	ask := func(url string, i int) string {
		body := map[string]any{"model": m.Name(), "prompt": fmt.Sprintf("Prompt %d is long enough to fill more than one block of sixteen tokens.", i),
			"max_tokens": 6, "temperature": 0, "ignore_eos": true}
		r, err := apiclient.Post(t.Context(), hc, url+"/v1/completions", body, nil)
		if err == nil {
			err = r.Check(url)
		}
		if err != nil {
			t.Fatalf("prompt %d to %s: %v", i, url, err)
		}
		return r.Text
	}
	for i := range 3 {
		if got, want := ask(s.URL, i), ask(s.Single.URL(), i); got != want {
			t.Errorf("prompt %d: P/D %q, single engine %q", i, got, want)
		}
	}
	for _, e := range []*stack.Engine{s.P, s.D} {
		if g := e.Instance().Pool.Geometry(); g.DType != kvcache.BFloat16 {
			t.Errorf("%s: KV cache %v, want bfloat16", e.Name, g.DType)
		}
	}
	if hits := s.D.Instance().Ranks[0].Engine.Stats().ExternalHits; hits == 0 {
		t.Error("D pulled no KV from P")
	}
}
