package check_test

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/kvbridge/kvbridge/check"
	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/proxy"
)

var tiny struct {
	once sync.Once
	m    *model.Model
	err  error
}

func openTiny(t *testing.T) *model.Model {
	t.Helper()
	tiny.once.Do(func() { tiny.m, tiny.err = model.Open(context.Background(), model.Tiny, model.OpenOptions{}) })
	if tiny.err != nil {
		t.Fatal(tiny.err)
	}
	return tiny.m
}

// eng describes one engine: its role ("" for no connector), auth token, bidirectional mode and
// whether its usage has prompt_tokens_details.
type eng struct {
	role     connector.Role
	token    string
	bidi     bool
	details  bool
	backends []string // kv_connector_extra_config.backends
	kvDType  string   // --kv-cache-dtype: another one changes the compatibility hash
}

// start starts the engine on a free port; its cleanup checks that its pool is full again.
func (e eng) start(t *testing.T) *instance.Instance {
	t.Helper()
	cfg := instance.Config{OpenedModel: openTiny(t), Host: "127.0.0.1", NumBlocks: 512, MaxModelLen: 2048, PrefixCaching: true,
		SideChannelPort: -1, PromptTokensDetails: e.details}
	if e.role != "" {
		cfg.KVTransfer = connector.DefaultConfig(e.role)
		cfg.KVTransfer.AuthToken = e.token
		cfg.KVTransfer.Bidirectional = e.bidi
		cfg.KVTransfer.Backends = e.backends
	}
	if e.kvDType != "" {
		cfg.OpenedModel, cfg.Model, cfg.KVCacheDType = nil, model.Tiny, e.kvDType
	}
	in, err := instance.Start(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := in.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
		if in.Pool.NumFree() != in.Pool.NumBlocks() {
			t.Errorf("%d of %d blocks free after close", in.Pool.NumFree(), in.Pool.NumBlocks())
		}
	})
	return in
}

// startProxy starts a proxy whose prefill instance is pURL and decode instance dURL.
func startProxy(t *testing.T, pURL, dURL string, multiTurn bool) string {
	t.Helper()
	inst := func(u string) proxy.Instance {
		host, port, err := net.SplitHostPort(strings.TrimPrefix(u, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		n, _ := strconv.Atoi(port)
		in, err := proxy.NewInstance(host, n)
		if err != nil {
			t.Fatal(err)
		}
		return in
	}
	cfg := proxy.Config{Prefill: []proxy.Instance{inst(pURL)}, Decode: []proxy.Instance{inst(dURL)}}
	var h interface {
		http.Handler
		Close() error
	}
	var err error
	if multiTurn {
		h, err = proxy.NewMultiTurn(proxy.MultiTurnConfig{Config: cfg})
	} else {
		h, err = proxy.NewOneWay(cfg)
	}
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(func() { srv.Close(); h.Close() })
	return srv.URL
}

// deployment is a P/D deployment as a person may have started it.
type deployment struct {
	name    string
	p, d    eng
	swapped bool // the proxy's prefill instance is D and its decode instance P
	multi   bool
	engines bool // check is given the engines' URLs
	want    []string
	says    string // a line of the report says this
}

func (dep deployment) run(t *testing.T) *check.Report {
	t.Helper()
	p, d := dep.p.start(t), dep.d.start(t)
	pre, dec := p.URL, d.URL
	if dep.swapped {
		pre, dec = dec, pre
	}
	cfg := check.Config{Proxy: startProxy(t, pre, dec, dep.multi)}
	if dep.engines {
		cfg.Prefill, cfg.Decode = []string{pre}, []string{dec}
	}
	r, err := check.Run(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	r.Print(&out)
	t.Logf("kvbridge check, %s:\n%s", dep.name, out.String())
	return r
}

const tokA, tokB = "tok-0123456789abcdef", "tok-fedcba9876543210"

// TestCheck: check's verdict on real engines behind the real proxy — OK for a healthy
// deployment, one-way or multi-turn, with the engines' URLs or only D's usage to go by; and for
// each misconfiguration that still answers (or used to answer) 200, the problem by name.
func TestCheck(t *testing.T) {
	producer, consumer := eng{role: connector.RoleProducer, token: tokA}, eng{role: connector.RoleConsumer, token: tokA}
	for _, dep := range []deployment{
		{name: "healthy one-way", p: producer, d: consumer, engines: true, says: "over SHM"},
		{name: "healthy one-way over TCP", p: eng{role: connector.RoleProducer, backends: []string{"TCP"}}, d: eng{role: connector.RoleConsumer, backends: []string{"TCP"}}, engines: true, says: "over TCP"},
		{name: "healthy one-way, proxy only, D reports usage details", p: producer, d: eng{role: connector.RoleConsumer, token: tokA, details: true}},
		{name: "healthy multi-turn", p: eng{role: connector.RoleProducer, bidi: true}, d: eng{role: connector.RoleConsumer, bidi: true, details: true}, multi: true, engines: true},
		{name: "P and D swapped", p: producer, d: consumer, swapped: true, engines: true, want: []string{check.ProblemSwapped}},
		{name: "P and D swapped, proxy only", p: producer, d: consumer, swapped: true, want: []string{check.ProblemSwapped}},
		{name: "auth token differs", p: producer, d: eng{role: connector.RoleConsumer, token: tokB}, engines: true, want: []string{check.ProblemAuth, check.ProblemNotPulled}},
		{name: "compatibility hash differs", p: producer, d: eng{role: connector.RoleConsumer, token: tokA, kvDType: "bfloat16"}, engines: true, want: []string{check.ProblemCompat, check.ProblemNotPulled}},
		{name: "auth token on P only", p: producer, d: eng{role: connector.RoleConsumer}, engines: true, want: []string{check.ProblemAuth}},
		{name: "consumer without connector", p: producer, d: eng{details: true}, engines: true, want: []string{check.ProblemNoConnector, check.ProblemNotPulled}},
		{name: "producer without connector, proxy only", p: eng{}, d: consumer, want: []string{check.ProblemNoConnector}},
		{name: "auth token differs, proxy only", p: producer, d: eng{role: connector.RoleConsumer, token: tokB, details: true}, want: []string{check.ProblemNotPulled}},
		{name: "multi-turn without bidirectional_kv_xfer", p: producer, d: eng{role: connector.RoleConsumer, token: tokA, details: true}, multi: true, engines: true, want: []string{check.ProblemNotReused}},
	} {
		t.Run(dep.name, func(t *testing.T) {
			r := dep.run(t)
			if dep.says != "" && !slices.ContainsFunc(r.Lines, func(l string) bool { return strings.Contains(l, dep.says) }) {
				t.Errorf("no line of the report says %q: %q", dep.says, r.Lines)
			}
			if len(dep.want) == 0 {
				if !r.OK() {
					t.Errorf("a healthy deployment: problems %+v", r.Problems)
				}
				return
			}
			if r.OK() {
				t.Fatalf("verdict OK, want %q", dep.want)
			}
			for _, w := range dep.want {
				if !r.Has(w) {
					t.Errorf("problems %+v, want %q among them", r.Problems, w)
				}
			}
		})
	}
}

// TestCheckConfigErrors: a config check cannot use is an error, never a verdict.
func TestCheckConfigErrors(t *testing.T) {
	for _, cfg := range []check.Config{{}, {Proxy: "ftp://x"}, {Proxy: "http://127.0.0.1:1", Decode: []string{"127.0.0.1:8200"}}} {
		if _, err := check.Run(t.Context(), cfg); err == nil {
			t.Errorf("Run(%+v) accepted the config", cfg)
		}
	}
}
