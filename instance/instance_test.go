package instance

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"runtime/debug"
	"runtime/pprof"
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/internal/fixture"
	"github.com/kvbridge/kvbridge/model"
)

// start starts an instance of kvbridge/tiny on loopback with cfg's sizing, logging into a buffer.
func start(t *testing.T, cfg Config) (*Instance, *fixture.LogBuffer, error) {
	t.Helper()
	logs := new(fixture.LogBuffer)
	cfg.Model, cfg.Host = model.Tiny, "127.0.0.1"
	cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
	in, err := Start(t.Context(), cfg)
	if err == nil {
		t.Cleanup(func() {
			in.Close()
			if free := in.Pool.NumFree(); free != in.Pool.NumBlocks() {
				t.Errorf("pool has %d of %d blocks free after Close", free, in.Pool.NumBlocks())
			}
		})
	}
	return in, logs, err
}

// servedMaxLen returns max_model_len as /v1/models reports it.
func servedMaxLen(t *testing.T, in *Instance) int {
	t.Helper()
	resp, err := http.Get(in.URL + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var body struct {
		Data []struct {
			MaxModelLen int `json:"max_model_len"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil || len(body.Data) == 0 {
		t.Fatalf("/v1/models: %v %+v", err, body)
	}
	return body.Data[0].MaxModelLen
}

// kvBytesPerBlock is kvbridge/tiny's block of 16 tokens: 2 layers × K,V × 2 heads × 16 dims × 4 bytes.
const kvBytesPerBlock = 2 * 2 * 2 * 16 * 16 * 4

func TestStartFitsTheContextToTheKVCache(t *testing.T) {
	// kvbridge/tiny's context is 32768 tokens; 100 blocks of 16 hold 1600.
	in, logs, err := start(t, Config{NumBlocks: 100})
	if err != nil {
		t.Fatal(err)
	}
	if got := servedMaxLen(t, in); got != 1600 {
		t.Fatalf("max_model_len %d, want 1600", got)
	}
	if l := logs.String(); !strings.Contains(l, "max_model_len=1600") || !strings.Contains(l, "model_context=32768") {
		t.Fatalf("the shortened context is not logged:\n%s", l)
	}

	// The whole context when it fits.
	in, _, err = start(t, Config{KVBytes: 2048 * kvBytesPerBlock})
	if err != nil {
		t.Fatal(err)
	}
	if got := servedMaxLen(t, in); got != 32768 {
		t.Fatalf("max_model_len %d, want the model's 32768", got)
	}
}

func TestStartRefusesAnExplicitLengthThatDoesNotFit(t *testing.T) {
	_, _, err := start(t, Config{NumBlocks: 100, MaxModelLen: 4096})
	if !errors.Is(err, ErrConfig) {
		t.Fatalf("err = %v, want ErrConfig", err)
	}
	for _, want := range []string{"max seq len (4096)", "estimated maximum model length is 1600", "--kv-cache-memory-bytes"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	if _, _, err := start(t, Config{NumBlocks: 4000, MaxModelLen: 40000}); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "max_position_embeddings 32768") {
		t.Fatalf("longer than the model: err = %v", err)
	}
}

func TestStartSizesTheKVCacheByMemoryUtilization(t *testing.T) {
	// Earlier tests leave garbage and freed pages that the runtime returns to the OS in the
	// background; were that to happen between this measurement and the instance's own, the
	// resident set would shrink by tens of MiB and the KV cache grow by as much. Collect and
	// return them first.
	debug.FreeOSMemory()
	total, resident, err := memoryFigures()
	if err != nil {
		t.Skipf("no memory figures on this system: %v", err)
	}
	// Ask for the current resident set plus 32 MiB of KV cache. The resident set moves a little
	// (the model loads, the runtime returns memory), so allow 16 MiB either way.
	util := float64(resident+32<<20) / float64(total)
	in, logs, err := start(t, Config{MemoryUtilization: util})
	if err != nil {
		t.Fatal(err)
	}
	kv := in.Pool.NumBlocks() * kvBytesPerBlock
	if kv < 16<<20 || kv > 48<<20 {
		t.Fatalf("KV cache %d bytes for utilization %g (resident %d of %d), want 32 MiB ± 16", kv, util, resident, total)
	}
	if !strings.Contains(logs.String(), "KV cache sized by memory utilization") {
		t.Fatalf("sizing not logged:\n%s", logs)
	}
	for _, bad := range []float64{1.5, -0.1, float64(resident/2) / float64(total)} {
		if _, _, err := start(t, Config{MemoryUtilization: bad}); !errors.Is(err, ErrConfig) {
			t.Errorf("utilization %g: err = %v, want ErrConfig", bad, err)
		}
	}
}

// TestConnectorCompatCoversDTypes: the connector's compatibility factors carry the model's
// --dtype, --kv-cache-dtype and --quantization, so engines that would exchange KV of another
// precision hash differently and the handshake refuses them.
func TestConnectorCompatCoversDTypes(t *testing.T) {
	hashes := map[string]string{}
	for _, tc := range []struct{ dtype, kv, q string }{{"float32", "auto", ""}, {"bfloat16", "float32", ""}, {"bfloat16", "auto", ""}, {"float32", "auto", "int8"}} {
		kv, err := connector.ParseConfig([]byte(`{"kv_connector":"NixlConnector","kv_role":"kv_producer"}`), nil)
		if err != nil {
			t.Fatal(err)
		}
		var compat connector.CompatFactors
		in, _, err := start(t, Config{NumBlocks: 64, DType: tc.dtype, KVCacheDType: tc.kv, Quantization: tc.q, KVTransfer: kv, SideChannelPort: -1,
			ConnectorHooks: func(o *connector.Options) { compat = o.Compat }})
		if err != nil {
			t.Fatal(err)
		}
		if compat.DType != in.Model.DType() || compat.CacheDType != in.Model.KVCacheDType() || compat.Quantization != tc.q || in.Pool.Geometry().DType.String() != in.Model.KVCacheDType() {
			t.Fatalf("--dtype %s --kv-cache-dtype %s: compat %+v, model %s/%s, pool %v", tc.dtype, tc.kv, compat, in.Model.DType(), in.Model.KVCacheDType(), in.Pool.Geometry().DType)
		}
		h := connector.CompatibilityHash(compat)
		for k, other := range hashes {
			if other == h {
				t.Fatalf("%s/%s/%s hashes like %s", tc.dtype, tc.kv, tc.q, k)
			}
		}
		hashes[tc.dtype+"/"+tc.kv+"/"+tc.q] = h
	}
}

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
	if got.BlockSize != 16 || got.MaxModelLen != mc.MaxPositionEmbeddings || got.NumBlocks != int((1<<30)/blockBytes) ||
		got.SideChannelHost != "localhost" || got.SideChannelPort != 5600 || got.StatsInterval != 10*time.Second ||
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
		{Config{NumBlocks: 3, MaxModelLen: 64}, "estimated maximum model length is 48"},
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
