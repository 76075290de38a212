// Package routebench measures the proxy's routing policies (`kvbridge bench routing`, issue 27
// item 4): N prefillers with small KV pools (so that prefixes are evicted) that publish their KV
// cache events, one decoder, and a shared-prefix workload — a few system prompts, many users,
// several turns each — run once per policy through a one-way proxy, from empty prefix caches.
// Per policy it reports the prefillers' prefix-cache hit rate next to an oracle's (at each
// request, the longest prefix any prefiller holds, read from the pools themselves), TTFT p50 and
// p99, the most loaded prefiller against the mean, this process's CPU per request, and how many
// answers differ from the first policy's (routing must change none). An unmeasured pass warms
// the process up first, so that no policy pays for running first.
//
// See docs/architecture.md for where the package sits among kvbridge's packages.
package routebench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/kvbridge/kvbridge/apiclient"
	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/internal/blockhash"
	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/kvevents"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/proxy"
	"github.com/kvbridge/kvbridge/stack"
	"github.com/kvbridge/kvbridge/stats"
)

// Options configure Run. Zero values take the defaults noted on each field.
type Options struct {
	// Model is the engines' model (default kvbridge/tiny).
	Model string
	// Prefillers is the number of prefill engines (default 3); PrefillBlocks the KV blocks of
	// each (default 64: fewer than the system prompts need together, so a prefiller that gets
	// every prefix evicts).
	Prefillers, PrefillBlocks int
	// Systems system prompts of SystemLen tokens (defaults 8 and 160) are shared by Users
	// conversations (default 48) of Turns turns each (default 2); a turn adds UserLen tokens
	// (default 24).
	Systems, SystemLen, Users, Turns, UserLen int
	// Concurrency conversations run at once (default 4); each request asks for MaxTokens
	// (default 4).
	Concurrency, MaxTokens int
	// Policies are run in this order (default round-robin, least-loaded, kv-aware).
	Policies []string
	// Seed chooses the prompts and the conversations' order (default 1).
	Seed uint64
	// Progress, if non-nil, receives one line per phase; Logger the engines' and proxy's logs.
	Progress io.Writer
	Logger   *slog.Logger
}

func (o *Options) defaults() error {
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	def(&o.Prefillers, 3)
	def(&o.PrefillBlocks, 64)
	def(&o.Systems, 8)
	def(&o.SystemLen, 160)
	def(&o.Users, 48)
	def(&o.Turns, 2)
	def(&o.UserLen, 24)
	def(&o.Concurrency, 4)
	def(&o.MaxTokens, 4)
	for name, v := range map[string]int{"prefillers": o.Prefillers, "prefill blocks": o.PrefillBlocks, "systems": o.Systems, "system length": o.SystemLen,
		"users": o.Users, "turns": o.Turns, "user length": o.UserLen, "concurrency": o.Concurrency, "max tokens": o.MaxTokens} {
		if v < 1 {
			return fmt.Errorf("routebench: %s %d: at least 1", name, v)
		}
	}
	if o.Model == "" {
		o.Model = model.Tiny
	}
	if len(o.Policies) == 0 {
		o.Policies = []string{proxy.RoundRobin, proxy.LeastLoaded, proxy.KVAware}
	}
	for _, p := range o.Policies {
		if _, err := proxy.ParsePolicy(p); err != nil {
			return fmt.Errorf("routebench: %w", err)
		}
	}
	if o.Seed == 0 {
		o.Seed = 1
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return nil
}

// Row is one policy's run.
type Row struct {
	Policy   string `json:"policy"`
	Requests int    `json:"requests"`
	// HitRate is the prefillers' prefix-cache hit tokens over their prompt tokens; OracleHitRate
	// what a router that knew every cache exactly would have found at each request (the longest
	// prefix any prefiller held, at most the prompt less one token); HitOfOracle their ratio.
	HitRate       float64 `json:"hit_rate"`
	OracleHitRate float64 `json:"oracle_hit_rate"`
	HitOfOracle   float64 `json:"hit_of_oracle"`
	// TTFT through the proxy, milliseconds.
	TTFTP50Ms float64 `json:"ttft_p50_ms"`
	TTFTP99Ms float64 `json:"ttft_p99_ms"`
	// MaxLoadOfMean is the most prompt tokens one prefiller received over the mean.
	MaxLoadOfMean float64 `json:"max_load_of_mean"`
	// CPUUsPerReq is this process's CPU time (clients, proxy and engines) per request.
	CPUUsPerReq float64 `json:"cpu_us_per_req"`
	// Differing counts answers that differ from the first policy's for the same request.
	Differing int `json:"differing"`
}

// hashSeed is the PYTHONHASHSEED the engines and the proxy share.
const hashSeed = "routebench"

// Run starts the engines and runs the workload once per policy.
func Run(ctx context.Context, opts Options) ([]Row, error) {
	if err := opts.defaults(); err != nil {
		return nil, err
	}
	progress := stack.Printer(opts.Progress)
	m, err := stack.OpenModel(ctx, opts.Model, opts.Progress)
	if err != nil {
		return nil, fmt.Errorf("routebench: %w", err)
	}
	defer m.Close()
	const bs = kvcache.DefaultBlockSize
	promptMax := opts.SystemLen + opts.Turns*(opts.UserLen+8)
	maxLen := (promptMax+opts.MaxTokens+bs-1)/bs*bs + bs
	if mp := m.Config().MaxPositionEmbeddings; maxLen > mp {
		return nil, fmt.Errorf("routebench: prompts of up to %d tokens exceed the model's %d positions", promptMax, mp)
	}
	if need := (promptMax + bs - 1) / bs; opts.PrefillBlocks < 2*need {
		return nil, fmt.Errorf("routebench: %d prefill blocks hold fewer than two of the longest prompts (%d blocks)", opts.PrefillBlocks, need)
	}
	hasher, err := blockhash.New(blockhash.SHA256, hashSeed, true)
	if err != nil {
		return nil, err
	}
	progress("starting %d prefillers (%d blocks each) and a decoder", opts.Prefillers, opts.PrefillBlocks)
	b := &bench{opts: opts, hc: &http.Client{Transport: stack.NewTransport(4 * opts.Concurrency)}}
	defer b.hc.CloseIdleConnections()
	defer b.close()
	for range opts.Prefillers {
		in, err := b.start(ctx, instance.Config{OpenedModel: m, NumBlocks: opts.PrefillBlocks, MaxModelLen: maxLen, BlockHashes: hasher}, connector.RoleProducer)
		if err != nil {
			return nil, err
		}
		b.prefill = append(b.prefill, in)
	}
	if b.decode, err = b.start(ctx, instance.Config{OpenedModel: m, NumBlocks: max(4*opts.Concurrency*(maxLen/bs), 256), MaxModelLen: maxLen}, connector.RoleConsumer); err != nil {
		return nil, err
	}
	work := b.workload(m.Config().VocabSize)
	// One unmeasured pass first: the first run in a fresh process is slower (allocations, page
	// faults, connections), which would count against whichever policy came first.
	progress("warm-up: the workload once through %s, not measured", opts.Policies[0])
	if _, _, err := b.run(ctx, opts.Policies[0], work); err != nil {
		return nil, err
	}
	var rows []Row
	var first [][]string
	for _, policy := range opts.Policies {
		progress("%s: %d conversations of %d turns, %d at once", policy, opts.Users, opts.Turns, opts.Concurrency)
		row, texts, err := b.run(ctx, policy, work)
		if err != nil {
			return rows, err
		}
		if first == nil {
			first = texts
		}
		for u := range texts {
			for t := range texts[u] {
				if texts[u][t] != first[u][t] {
					row.Differing++
				}
			}
		}
		rows = append(rows, row)
	}
	return rows, nil
}

// bench is one Run's engines.
type bench struct {
	opts    Options
	hc      *http.Client
	prefill []*instance.Instance
	decode  *instance.Instance
	all     []*instance.Instance
}

func (b *bench) close() {
	for _, in := range b.all {
		_ = in.Close()
	}
}

// start starts an engine of role: prefillers publish KV events (a free port, a replay socket)
// and serve POST /reset_prefix_cache.
func (b *bench) start(ctx context.Context, cfg instance.Config, role connector.Role) (*instance.Instance, error) {
	kv, err := connector.ParseConfig([]byte(`{"kv_connector":"NixlConnector","kv_role":"`+string(role)+`"}`), nil)
	if err != nil {
		return nil, err
	}
	cfg.Host, cfg.SideChannelPort, cfg.KVTransfer, cfg.Logger = "127.0.0.1", -1, kv, b.opts.Logger
	if role == connector.RoleProducer {
		ev, err := kvevents.ParseConfig(`{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://127.0.0.1:0"}`)
		if err != nil {
			return nil, err
		}
		cfg.KVEvents, cfg.DevMode, cfg.PrefixCaching = &ev, true, true
	}
	in, err := instance.Start(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("routebench: %w", err)
	}
	b.all = append(b.all, in)
	return in, nil
}

// workload returns each conversation's turns as token prompts: a system prompt, then per turn
// an answer-sized filler (after the first) and the user's tokens. The same for every policy.
func (b *bench) workload(vocab int) [][][]int32 {
	o := b.opts
	rng := rand.New(rand.NewPCG(o.Seed, 27))
	tok := func(n int) []int32 {
		out := make([]int32, n)
		for i := range out {
			out[i] = int32(10 + rng.IntN(vocab-20))
		}
		return out
	}
	systems := make([][]int32, o.Systems)
	for i := range systems {
		systems[i] = tok(o.SystemLen)
	}
	convs := make([][][]int32, o.Users)
	for u := range convs {
		prompt := append([]int32(nil), systems[rng.IntN(o.Systems)]...)
		for t := range o.Turns {
			if t > 0 {
				prompt = append(prompt, tok(8)...)
			}
			prompt = append(prompt, tok(o.UserLen)...)
			convs[u] = append(convs[u], append([]int32(nil), prompt...))
		}
	}
	return convs
}

// run runs the workload through a new proxy of policy, from empty prefix caches.
func (b *bench) run(ctx context.Context, policy string, work [][][]int32) (Row, [][]string, error) {
	row := Row{Policy: policy}
	for _, in := range b.prefill {
		if err := b.resetPrefixCache(ctx, in); err != nil {
			return row, nil, err
		}
	}
	url, stop, err := b.proxy(policy)
	if err != nil {
		return row, nil, err
	}
	defer stop()
	before := make([]instance.Stats, len(b.prefill))
	for i, in := range b.prefill {
		if before[i], err = in.Stats(); err != nil {
			return row, nil, err
		}
	}
	texts := make([][]string, len(work))
	var (
		mu           sync.Mutex
		ttft         []float64
		oracle, sent int64
	)
	convs := make(chan int)
	errc := make(chan error, b.opts.Concurrency)
	cpu0 := processCPU()
	var wg sync.WaitGroup
	for range b.opts.Concurrency {
		wg.Go(func() {
			for u := range convs {
				for _, prompt := range work[u] {
					best := b.oracle(prompt)
					r, err := apiclient.Post(ctx, b.hc, url+"/v1/completions", map[string]any{"model": b.opts.Model, "prompt": prompt,
						"max_tokens": b.opts.MaxTokens, "temperature": 0, "stream": true}, nil)
					if err == nil {
						err = r.Check(url)
					}
					if err != nil {
						errc <- err
						return
					}
					mu.Lock()
					texts[u] = append(texts[u], r.Text)
					ttft = append(ttft, float64(r.TTFT)/float64(time.Millisecond))
					oracle += int64(best)
					sent += int64(len(prompt))
					mu.Unlock()
				}
			}
		})
	}
	order := rand.New(rand.NewPCG(b.opts.Seed, 4)).Perm(len(work))
feed:
	for _, u := range order {
		select {
		case convs <- u:
		case err = <-errc:
			break feed
		}
	}
	close(convs)
	wg.Wait()
	if err == nil && len(errc) > 0 {
		err = <-errc
	}
	if err != nil {
		return row, nil, fmt.Errorf("routebench: %s: %w", policy, err)
	}
	row.CPUUsPerReq = float64(processCPU()-cpu0) / float64(time.Microsecond) / float64(len(ttft))
	var prompt, hit int64
	loads := make([]float64, len(b.prefill))
	for i, in := range b.prefill {
		st, err := in.Stats()
		if err != nil {
			return row, nil, err
		}
		prompt += st.PromptTokens - before[i].PromptTokens
		hit += st.PrefixHitTokens - before[i].PrefixHitTokens
		loads[i] = float64(st.PromptTokens - before[i].PromptTokens)
	}
	row.Requests = len(ttft)
	row.HitRate = float64(hit) / float64(max(prompt, 1))
	row.OracleHitRate = float64(oracle) / float64(max(sent, 1))
	if row.OracleHitRate > 0 {
		row.HitOfOracle = row.HitRate / row.OracleHitRate
	}
	row.TTFTP50Ms, row.TTFTP99Ms = stats.NearestRank(ttft, 0.5), stats.NearestRank(ttft, 0.99)
	mean := 0.0
	for _, l := range loads {
		mean += l / float64(len(loads))
	}
	for _, l := range loads {
		row.MaxLoadOfMean = max(row.MaxLoadOfMean, l/max(mean, 1))
	}
	return row, texts, nil
}

// oracle returns the most tokens of prompt one prefiller holds now (at most all but the last
// token, which an engine always computes).
func (b *bench) oracle(prompt []int32) int {
	hashes := kvcache.ChainHashes(prompt, kvcache.DefaultBlockSize)
	best := 0
	for _, in := range b.prefill {
		best = max(best, in.Ranks[0].Pool.Lookup(hashes))
	}
	return min(best*kvcache.DefaultBlockSize, len(prompt)-1)
}

// resetPrefixCache empties in's prefix cache, waiting (under a deadline) for the blocks its
// leases still hold for the decoder.
func (b *bench) resetPrefixCache(ctx context.Context, in *instance.Instance) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, in.URL+"/reset_prefix_cache", nil)
		if err != nil {
			return err
		}
		resp, err := b.hc.Do(req)
		if err != nil {
			return fmt.Errorf("routebench: reset_prefix_cache: %w", err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		switch resp.StatusCode {
		case http.StatusOK:
			return nil
		case http.StatusConflict: // blocks still held: retry
		default:
			return fmt.Errorf("routebench: reset_prefix_cache: %s", resp.Status)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("routebench: reset_prefix_cache: %w", ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// proxy starts a one-way proxy of policy over the engines, subscribed to the prefillers'
// events (and their replay sockets) whatever the policy, and returns its URL and its stop.
func (b *bench) proxy(policy string) (string, func(), error) {
	d, err := instanceOf(b.decode)
	if err != nil {
		return "", nil, err
	}
	cfg := proxy.Config{Decode: []proxy.Instance{d}, Logger: b.opts.Logger, Transport: b.hc.Transport,
		Routing: proxy.RoutingConfig{Policy: policy, HashSeed: hashSeed, HashSeeded: true}}
	for _, in := range b.prefill {
		p, err := instanceOf(in)
		if err != nil {
			return "", nil, err
		}
		cfg.Prefill = append(cfg.Prefill, p)
		pub := in.Ranks[0].KVEvents
		cfg.Routing.KVEvents = append(cfg.Routing.KVEvents, "tcp://127.0.0.1:"+strconv.Itoa(pub.Addr().(*net.TCPAddr).Port))
		cfg.Routing.KVEventsReplay = append(cfg.Routing.KVEventsReplay, "tcp://"+pub.ReplayAddr().String())
	}
	px, err := proxy.NewOneWay(cfg)
	if err != nil {
		return "", nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		px.Close()
		return "", nil, err
	}
	srv := &http.Server{Handler: px, ReadHeaderTimeout: 10 * time.Second}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	stop := func() {
		_ = srv.Close()
		if err := <-done; err != nil && !errors.Is(err, http.ErrServerClosed) {
			b.opts.Logger.Warn("routebench: proxy", "err", err)
		}
		px.Close()
	}
	return "http://" + ln.Addr().String(), stop, nil
}

// instanceOf is the proxy's address of an engine.
func instanceOf(in *instance.Instance) (proxy.Instance, error) {
	return proxy.NewInstance(in.Addr.IP.String(), in.Addr.Port)
}

// processCPU returns this process's CPU time so far, user plus system (0 if unavailable).
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
