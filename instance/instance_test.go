package instance

import (
	"bytes"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/model"
)

// syncBuffer is a bytes.Buffer safe for the logger's concurrent writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// start starts an instance of kvbridge/tiny on loopback with cfg's sizing, logging into a buffer.
func start(t *testing.T, cfg Config) (*Instance, *syncBuffer, error) {
	t.Helper()
	logs := new(syncBuffer)
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
// --dtype and --kv-cache-dtype, so engines that would exchange KV of another precision hash
// differently and the handshake refuses them.
func TestConnectorCompatCoversDTypes(t *testing.T) {
	hashes := map[string]string{}
	for _, tc := range []struct{ dtype, kv string }{{"float32", "auto"}, {"bfloat16", "auto"}, {"bfloat16", "bfloat16"}} {
		kv, err := connector.ParseConfig([]byte(`{"kv_connector":"NixlConnector","kv_role":"kv_producer"}`), nil)
		if err != nil {
			t.Fatal(err)
		}
		var compat connector.CompatFactors
		in, _, err := start(t, Config{NumBlocks: 64, DType: tc.dtype, KVCacheDType: tc.kv, KVTransfer: kv, SideChannelPort: -1,
			ConnectorHooks: func(o *connector.Options) { compat = o.Compat }})
		if err != nil {
			t.Fatal(err)
		}
		if compat.DType != in.Model.DType() || compat.CacheDType != in.Model.KVCacheDType() || in.Pool.Geometry().DType.String() != in.Model.KVCacheDType() {
			t.Fatalf("--dtype %s --kv-cache-dtype %s: compat %+v, model %s/%s, pool %v", tc.dtype, tc.kv, compat, in.Model.DType(), in.Model.KVCacheDType(), in.Pool.Geometry().DType)
		}
		h := connector.CompatibilityHash(compat)
		for k, other := range hashes {
			if other == h {
				t.Fatalf("%s/%s hashes like %s", tc.dtype, tc.kv, k)
			}
		}
		hashes[tc.dtype+"/"+tc.kv] = h
	}
}
