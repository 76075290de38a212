package check_test

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/kvbridge/kvbridge/check"
	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/stack"
)

var tiny struct {
	once sync.Once
	m    *model.Model
	err  error
}

func openTiny(t *testing.T) *model.Model {
	t.Helper()
	tiny.once.Do(func() { tiny.m, tiny.err = stack.OpenModel(context.Background(), model.Tiny, nil) })
	if tiny.err != nil {
		t.Fatal(tiny.err)
	}
	return tiny.m
}

// start starts an engine of e (Role "": no connector; KVCacheDType: a model of its own) on free
// ports; its cleanup checks that its pool is full again.
func start(t *testing.T, e stack.EngineConfig) *stack.Engine {
	t.Helper()
	if e.KVCacheDType == "" {
		e.Model = openTiny(t)
	} else {
		e.ModelName = model.Tiny
	}
	e.NumBlocks, e.MaxModelLen, e.PrefixCaching = 512, 2048, true
	se, err := stack.StartEngine(t.Context(), e)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		in := se.Instance()
		if err := se.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
		if in.Pool.NumFree() != in.Pool.NumBlocks() {
			t.Errorf("%d of %d blocks free after close", in.Pool.NumFree(), in.Pool.NumBlocks())
		}
	})
	return se
}

// deployment is a P/D deployment as a person may have started it.
type deployment struct {
	name    string
	p, d    stack.EngineConfig
	swapped bool // the proxy's prefill instance is D and its decode instance P
	multi   bool
	engines bool // check is given the engines' URLs
	want    []string
	says    string // a line of the report says this
	detail  string // a problem's detail says this
}

func (dep deployment) run(t *testing.T) *check.Report {
	t.Helper()
	p, d := start(t, dep.p), start(t, dep.d)
	pre, dec := p, d
	if dep.swapped {
		pre, dec = d, p
	}
	addr := func(e *stack.Engine) string { return strings.TrimPrefix(e.URL(), "http://") }
	px, err := stack.StartProxy(stack.ProxyConfig{Prefill: []string{addr(pre)}, Decode: []string{addr(dec)}, MultiTurn: dep.multi})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { px.Close() })
	cfg := check.Config{Proxy: px.URL}
	if dep.engines {
		cfg.Prefill, cfg.Decode = []string{pre.URL()}, []string{dec.URL()}
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
	producer := stack.EngineConfig{Role: connector.RoleProducer, AuthToken: tokA}
	consumer := stack.EngineConfig{Role: connector.RoleConsumer, AuthToken: tokA}
	bidi := func(e stack.EngineConfig) stack.EngineConfig { e.Bidirectional = true; return e }
	tcp := func(e stack.EngineConfig) stack.EngineConfig { e.Backends = []string{"TCP"}; return e }
	token := func(e stack.EngineConfig, tok string) stack.EngineConfig { e.AuthToken = tok; return e }
	push := func(e stack.EngineConfig) stack.EngineConfig {
		e.KVTransferConfig = []byte(`{"kv_connector":"NixlPushConnector"}`)
		return e
	}
	for _, dep := range []deployment{
		{name: "healthy one-way", p: producer, d: consumer, engines: true, says: "over SHM"},
		{name: "healthy one-way over TCP", p: tcp(producer), d: tcp(consumer), engines: true, says: "over TCP"},
		{name: "healthy one-way, proxy only", p: producer, d: consumer, says: "pulled from P"},
		{name: "healthy push", p: push(producer), d: push(consumer), engines: true, says: "over SHM"},
		{name: "healthy push over TCP", p: tcp(push(producer)), d: tcp(push(consumer)), engines: true, says: "over TCP"},
		{name: "healthy multi-turn", p: bidi(producer), d: bidi(consumer), multi: true, engines: true, says: "second turn hit"},
		{name: "P and D swapped", p: producer, d: consumer, swapped: true, engines: true, want: []string{check.ProblemSwapped}},
		{name: "P and D swapped, proxy only", p: producer, d: consumer, swapped: true, want: []string{check.ProblemSwapped}},
		{name: "auth token differs", p: producer, d: token(consumer, tokB), engines: true, want: []string{check.ProblemAuth, check.ProblemNotPulled}},
		{name: "auth token differs, proxy only", p: producer, d: token(consumer, tokB), want: []string{check.ProblemNotPulled}},
		{name: "auth token on P only", p: producer, d: token(consumer, ""), engines: true, want: []string{check.ProblemAuth}},
		{name: "compatibility hash differs", p: producer, d: stack.EngineConfig{Role: connector.RoleConsumer, AuthToken: tokA, KVCacheDType: "bfloat16"}, engines: true, want: []string{check.ProblemCompat, check.ProblemNotPulled},
			detail: `(cache_dtype "float32" (http://`},
		{name: "consumer without connector", p: producer, d: stack.EngineConfig{}, engines: true, want: []string{check.ProblemNoConnector, check.ProblemNotPulled},
			detail: "ignored the kv_transfer_params of 3 request(s)"},
		{name: "producer without connector, proxy only", p: stack.EngineConfig{}, d: consumer, want: []string{check.ProblemNoConnector}},
		{name: "multi-turn without bidirectional_kv_xfer", p: producer, d: consumer, multi: true, engines: true, want: []string{check.ProblemNotReused}},
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
			if dep.detail != "" && !slices.ContainsFunc(r.Problems, func(f check.Finding) bool { return strings.Contains(f.Detail, dep.detail) }) {
				t.Errorf("no problem says %q: %+v", dep.detail, r.Problems)
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
