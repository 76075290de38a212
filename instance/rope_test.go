package instance_test

import (
	"log/slog"
	"testing"

	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/internal/fixture"
	"github.com/kvbridge/kvbridge/model"
)

// TestDynamicRopeSaysWhoseFormula: a checkpoint whose config has rope_scaling {"rope_type":
// "dynamic"} starts with an INFO line saying that its RoPE follows vLLM's formula and how that
// differs from transformers'; a checkpoint with another scaling does not get it.
func TestDynamicRopeSaysWhoseFormula(t *testing.T) {
	for _, typ := range []string{"dynamic", "linear"} {
		t.Run(typ, func(t *testing.T) {
			dir := smallCheckpoint(t, "BF16", &model.RopeScaling{Type: typ, Factor: 2, OriginalMaxPositionEmbeddings: 1024})
			logs := new(fixture.LogBuffer)
			in, err := instance.Start(t.Context(), instance.Config{Model: dir, Host: "127.0.0.1", NumBlocks: 16,
				Logger: slog.New(slog.NewTextHandler(logs, nil))})
			if err != nil {
				t.Fatal(err)
			}
			in.Close()
			if free := in.Pool.NumFree(); free != in.Pool.NumBlocks() {
				t.Errorf("pool has %d of %d blocks free after Close", free, in.Pool.NumBlocks())
			}
			if in.Model.Config().RopeScaling == nil || in.Model.Config().RopeScaling.Type != typ {
				t.Fatalf("the checkpoint's RoPE scaling was read as %+v", in.Model.Config().RopeScaling)
			}
			said := logs.HasLine("level=INFO", "dynamic RoPE scaling uses vLLM's formula, not transformers'", "transformers keeps the original base",
				"factor=2", "original_max_position_embeddings=1024")
			if said != (typ == "dynamic") {
				t.Errorf("%s: the line about vLLM's dynamic RoPE formula logged: %v, want %v:\n%s", typ, said, typ == "dynamic", logs)
			}
		})
	}
}
