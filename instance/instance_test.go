package instance

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"runtime/pprof"
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/model"
)

// openTiny opens kvbridge/tiny for one test.
func openTiny(t *testing.T) *model.Model {
	m, err := model.Open(t.Context(), model.Tiny, model.OpenOptions{})
	if err == nil {
		t.Cleanup(func() { m.Close() })
		return m
	}
	t.Fatal(err)
	return nil
}

// TestWithDefaults: every zero field takes its documented default, and set fields stay. The
// expected pool size is derived by hand from the model's shape: one block holds, for every layer,
// keys and values of every KV head for 16 tokens of HeadDim float32s.
func TestWithDefaults(t *testing.T) {
	m := openTiny(t)
	mc := m.Config()
	blockBytes := int64(mc.NumLayers * 2 * mc.NumKVHeads * 16 * mc.HeadDim * 4)
	got, err := Config{}.withDefaults(m)
	if err != nil {
		t.Fatal(err)
	}
	if got.BlockSize != 16 || got.MaxModelLen != min(mc.MaxPositionEmbeddings, 32768) || got.NumBlocks != int((1<<30)/blockBytes) ||
		got.KVBytes != 1<<30 || got.SideChannelHost != "localhost" || got.SideChannelPort != 5600 || got.StatsInterval != 10*time.Second ||
		len(got.ServedModelNames) != 1 || got.ServedModelNames[0] != m.Name() || got.Logger == nil {
		t.Errorf("defaults: %+v", got)
	}

	set := Config{Model: "served-as", BlockSize: 32, MaxModelLen: 512, KVBytes: 64 * blockBytes, SideChannelHost: "10.0.0.1",
		SideChannelPort: 7000, StatsInterval: time.Second, ServedModelNames: []string{"a", "b"}}
	got, err = set.withDefaults(m)
	if err != nil {
		t.Fatal(err)
	}
	// 32-token blocks are twice as large: 64 blocks of 16 tokens' memory hold 32 of them.
	if got.BlockSize != 32 || got.MaxModelLen != 512 || got.NumBlocks != 32 || got.SideChannelHost != "10.0.0.1" ||
		got.SideChannelPort != 7000 || got.StatsInterval != time.Second || strings.Join(got.ServedModelNames, ",") != "a,b" {
		t.Errorf("set fields: %+v", got)
	}

	got, err = Config{Model: "served-as", NumBlocks: 100, MaxModelLen: 1600, SideChannelPort: -1}.withDefaults(m)
	if err != nil {
		t.Fatal(err)
	}
	if got.NumBlocks != 100 || got.SideChannelPort != 0 || got.ServedModelNames[0] != "served-as" {
		t.Errorf("NumBlocks over KVBytes, a free side-channel port, the model argument as name: %+v", got)
	}
}

// TestWithDefaultsErrors: a configuration that cannot work is an ErrConfig naming the setting.
func TestWithDefaultsErrors(t *testing.T) {
	m := openTiny(t)
	mc := m.Config()
	for _, tc := range []struct {
		cfg  Config
		want string
	}{
		{Config{BlockSize: -1}, "block size -1"},
		{Config{BlockSize: 2048}, "block size 2048"},
		{Config{MaxModelLen: mc.MaxPositionEmbeddings + 1}, "max_position_embeddings"},
		{Config{NumBlocks: 3, MaxModelLen: 64}, "one 64-token sequence needs 4"},
	} {
		_, err := tc.cfg.withDefaults(m)
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v; want ErrConfig naming %q", tc.cfg, err, tc.want)
		}
	}
}

// TestStartAndClose: an engine with a connector serves a completion, Stats counts it, and Close —
// twice — leaves the pool full and no "KV Transfer metrics" logger behind.
func TestStartAndClose(t *testing.T) {
	m := openTiny(t)
	in, err := Start(t.Context(), Config{OpenedModel: m, Host: "127.0.0.1", NumBlocks: 64, MaxModelLen: 512,
		KVTransfer: connector.DefaultConfig(connector.RoleProducer), SideChannelPort: -1, StatsInterval: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	body, _ := json.Marshal(map[string]any{"model": model.Tiny, "prompt": "one two three four", "max_tokens": 3, "temperature": 0})
	resp, err := http.Post(in.URL+"/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("completion: %d %s", resp.StatusCode, raw)
	}
	st, err := in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if st.PromptTokens <= 0 || st.TTFT <= 0 || st.NumBlocks != 64 || st.Transfers != 0 {
		t.Errorf("stats after one completion: %+v", st)
	}
	if err := in.Close(); err != nil {
		t.Fatal(err)
	}
	if err := in.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	var stacks bytes.Buffer
	_ = pprof.Lookup("goroutine").WriteTo(&stacks, 1)
	if strings.Contains(stacks.String(), "LogEvery") {
		t.Errorf("the metrics logger still runs after Close:\n%s", stacks.String())
	}
	if st, _ := in.Stats(); st.FreeBlocks != st.NumBlocks {
		t.Errorf("%d of %d blocks free after Close", st.FreeBlocks, st.NumBlocks)
	}
}
