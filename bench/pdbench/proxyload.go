package pdbench

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/google/uuid"
	"golang.org/x/sync/errgroup"

	"github.com/kvbridge/kvbridge/apiclient"
	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/stack"
	"github.com/kvbridge/kvbridge/stats"
)

// ProxyOptions configure RunProxy. Zero values take the defaults noted on each field.
type ProxyOptions struct {
	// Model is the engines' model (default kvbridge/tiny).
	Model string
	// Clients are the concurrency levels, one row each per max_tokens (default 1, 4, 16, 64, 256).
	Clients []int
	// MaxTokens are the max_tokens values of the requests (default 1, 16).
	MaxTokens []int
	// Duration is the measured time of each way of each row (default 3 s), split into Rounds
	// windows that alternate between the two ways so that a change in the machine's load
	// during the row affects both alike.
	Duration time.Duration
	// Rounds is the number of windows per way and row (default 3).
	Rounds int
	// Warmup precedes every measured window, unmeasured (default Duration/Rounds/5, at most 200 ms).
	Warmup time.Duration
	// PromptLen is the prompt length in tokens (default 32).
	PromptLen int
	// Seed chooses the prompts (default 1).
	Seed uint64
	// Progress, if non-nil, receives one line per phase.
	Progress io.Writer
	// Logger receives the engines' and the proxy's logs; nil discards.
	Logger *slog.Logger
}

func (o *ProxyOptions) defaults() error {
	if o.Model == "" {
		o.Model = model.Tiny
	}
	if len(o.Clients) == 0 {
		o.Clients = []int{1, 4, 16, 64, 256}
	}
	if len(o.MaxTokens) == 0 {
		o.MaxTokens = []int{1, 16}
	}
	for _, c := range o.Clients {
		if c <= 0 {
			return fmt.Errorf("pdbench: %d clients: at least 1", c)
		}
	}
	for _, t := range o.MaxTokens {
		if t <= 0 {
			return fmt.Errorf("pdbench: max_tokens %d: at least 1", t)
		}
	}
	if o.Duration <= 0 {
		o.Duration = 3 * time.Second
	}
	if o.Rounds <= 0 {
		o.Rounds = 3
	}
	if o.Warmup <= 0 {
		o.Warmup = min(o.Duration/time.Duration(o.Rounds)/5, 200*time.Millisecond)
	}
	if o.PromptLen <= 0 {
		o.PromptLen = 32
	}
	if o.Seed == 0 {
		o.Seed = 1
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return nil
}

// ProxyRow is one (clients, max_tokens) pair measured both ways.
type ProxyRow struct {
	Clients   int `json:"clients"`
	MaxTokens int `json:"max_tokens"`
	// DirectRPS and ProxyRPS are completed requests per second; RPSRatio proxy ÷ direct.
	DirectRPS float64 `json:"direct_rps"`
	ProxyRPS  float64 `json:"proxy_rps"`
	RPSRatio  float64 `json:"rps_ratio"`
	// Latencies of whole requests (both legs), milliseconds.
	DirectP50Ms float64 `json:"direct_p50_ms"`
	DirectP99Ms float64 `json:"direct_p99_ms"`
	ProxyP50Ms  float64 `json:"proxy_p50_ms"`
	ProxyP99Ms  float64 `json:"proxy_p99_ms"`
	// AddedP50Ms and AddedP99Ms are proxy − direct at that percentile.
	AddedP50Ms float64 `json:"added_p50_ms"`
	AddedP99Ms float64 `json:"added_p99_ms"`
	// DirectCPUUs and ProxyCPUUs are this process's CPU time (user + system: clients, proxy and
	// both engines) per request in the measured windows; AddedCPUUs their difference, what one
	// request through the proxy costs in CPU beyond making the two legs directly.
	DirectCPUUs float64 `json:"direct_cpu_us_per_req"`
	ProxyCPUUs  float64 `json:"proxy_cpu_us_per_req"`
	AddedCPUUs  float64 `json:"added_cpu_us_per_req"`

	DirectRequests int    `json:"direct_requests"`
	ProxyRequests  int    `json:"proxy_requests"`
	Model          string `json:"model"`
	PromptLen      int    `json:"prompt_len"`
	Duration       string `json:"duration"`
	Rounds         int    `json:"rounds"`
}

// RunProxy starts P, D and the one-way proxy in this process and, for every concurrency level
// and max_tokens, runs a closed loop of requests through the proxy and one making the same two
// legs straight to the engines, in that order, and compares them.
func RunProxy(ctx context.Context, opts ProxyOptions) ([]ProxyRow, error) {
	if err := opts.defaults(); err != nil {
		return nil, err
	}
	progress := stack.Printer(opts.Progress)
	m, err := stack.OpenModel(ctx, opts.Model, opts.Progress)
	if err != nil {
		return nil, fmt.Errorf("pdbench: %w", err)
	}
	defer m.Close()
	const bs = kvcache.DefaultBlockSize
	maxTok := slices.Max(opts.MaxTokens)
	maxLen := (opts.PromptLen+maxTok+bs-1)/bs*bs + bs
	if mp := m.Config().MaxPositionEmbeddings; maxLen > mp {
		return nil, fmt.Errorf("pdbench: %d prompt + %d generated tokens exceed the model's %d positions", opts.PromptLen, maxTok, mp)
	}
	clients := slices.Max(opts.Clients)
	// One transport for the clients and the proxy's legs, with idle connections for every client.
	tr := stack.NewTransport(max(2*clients, 64))
	defer tr.CloseIdleConnections()
	// P holds each request's blocks until D has read them: room for every client's request on
	// both engines several times over.
	numBlocks := max(4*clients*(maxLen/bs), 2*maxLen/bs)
	progress("starting P, D and the proxy")
	c, err := stack.Start(ctx, stack.Config{
		Model: m, BlockSize: bs, NumBlocks: numBlocks, MaxModelLen: maxLen, Proxy: stack.ProxyConfig{Transport: tr}, Logger: opts.Logger,
	})
	if err != nil {
		return nil, fmt.Errorf("pdbench: %w", err)
	}
	defer c.Close()
	l := &loader{opts: opts, m: m, c: c, hc: &http.Client{Transport: tr}}
	if opts.Duration < time.Duration(opts.Rounds) {
		return nil, fmt.Errorf("pdbench: duration %s is too short for %d rounds", opts.Duration, opts.Rounds)
	}
	var rows []ProxyRow
	window := l.opts.Duration / time.Duration(l.opts.Rounds)
	for _, mt := range opts.MaxTokens {
		for _, n := range opts.Clients {
			progress("%d clients, max_tokens %d: %d rounds of %s direct and %s through the proxy", n, mt, opts.Rounds, window, window)
			var direct, proxied loopResult
			for round := range opts.Rounds {
				// Alternate which way goes first.
				ways := []*loopResult{&direct, &proxied}
				dos := []func(context.Context, request) error{l.direct, l.proxied}
				if round%2 == 1 {
					ways[0], ways[1], dos[0], dos[1] = ways[1], ways[0], dos[1], dos[0]
				}
				for k := range ways {
					r, err := l.closedLoop(ctx, n, mt, window, dos[k])
					if err != nil {
						return rows, err
					}
					ways[k].add(r)
				}
			}
			r := ProxyRow{
				Clients: n, MaxTokens: mt,
				DirectRPS: direct.rps(), ProxyRPS: proxied.rps(),
				DirectP50Ms: stats.NearestRank(direct.lat, 0.5), DirectP99Ms: stats.NearestRank(direct.lat, 0.99),
				ProxyP50Ms: stats.NearestRank(proxied.lat, 0.5), ProxyP99Ms: stats.NearestRank(proxied.lat, 0.99),
				DirectCPUUs: direct.cpuPerReq(), ProxyCPUUs: proxied.cpuPerReq(),
				DirectRequests: len(direct.lat), ProxyRequests: len(proxied.lat),
				Model: m.Name(), PromptLen: opts.PromptLen, Duration: opts.Duration.String(), Rounds: opts.Rounds,
			}
			r.RPSRatio = r.ProxyRPS / r.DirectRPS
			r.AddedP50Ms = r.ProxyP50Ms - r.DirectP50Ms
			r.AddedP99Ms = r.ProxyP99Ms - r.DirectP99Ms
			r.AddedCPUUs = r.ProxyCPUUs - r.DirectCPUUs
			rows = append(rows, r)
		}
	}
	return rows, nil
}

// loader is one RunProxy's state.
type loader struct {
	opts ProxyOptions
	m    *model.Model
	c    *stack.Stack
	hc   *http.Client
}

// request is what one client asks for: its prompt and max_tokens.
type request struct {
	prompt    []int32
	maxTokens int
}

// clientBody is the client's request (what the proxy receives and D gets, plus the params).
func (l *loader) clientBody(r request) map[string]any {
	return map[string]any{"model": l.m.Name(), "prompt": r.prompt, "max_tokens": r.maxTokens, "temperature": 0, "ignore_eos": true}
}

// proxied sends one request through the proxy.
func (l *loader) proxied(ctx context.Context, r request) error {
	return post(ctx, l.hc, l.c.URL+"/v1/completions", "", l.clientBody(r))
}

// direct makes the proxy's two legs itself: P with max_tokens 1 and do_remote_decode, then D
// with the client's body and P's kv_transfer_params, one X-Request-Id for both.
func (l *loader) direct(ctx context.Context, r request) error {
	id := uuid.NewString()
	pb := l.clientBody(r)
	pb["max_tokens"], pb["stream"] = 1, false
	pb["kv_transfer_params"] = map[string]any{
		"do_remote_decode": true, "do_remote_prefill": false,
		"remote_engine_id": nil, "remote_block_ids": nil, "remote_host": nil, "remote_port": nil,
	}
	hdr := http.Header{"X-Request-Id": {id}}
	url := l.c.P.URL() + "/v1/completions"
	ans, err := apiclient.Post(ctx, l.hc, url, pb, hdr)
	if err == nil {
		err = ans.Check(url)
	}
	if err != nil {
		return fmt.Errorf("pdbench: %w", err)
	}
	if ans.KVTransferParams == nil {
		return fmt.Errorf("pdbench: P returned no kv_transfer_params: %.300s", ans.Raw)
	}
	db := l.clientBody(r)
	db["kv_transfer_params"] = ans.KVTransferParams
	return post(ctx, l.hc, l.c.D.URL()+"/v1/completions", id, db)
}

// loopResult is the measured requests of one or more closed-loop windows.
type loopResult struct {
	lat     []float64     // latencies (ms) of the requests started in the measured windows
	elapsed time.Duration // total measured time
	cpu     time.Duration // this process's CPU time in the measured windows
}

func (r *loopResult) add(o loopResult) {
	r.lat = append(r.lat, o.lat...)
	r.elapsed += o.elapsed
	r.cpu += o.cpu
}

func (r *loopResult) rps() float64 { return float64(len(r.lat)) / r.elapsed.Seconds() }

func (r *loopResult) cpuPerReq() float64 {
	return float64(r.cpu) / float64(time.Microsecond) / float64(len(r.lat))
}

// closedLoop runs n clients, each sending its next request as soon as the previous one is
// answered, for the warm-up and then a measured window of length d. Requests started in the
// window are measured (the last ones finish after it); the measured time runs from the window's
// start to the last of them finishing. A client whose requests take longer than the window (a
// short window, or a loaded machine) still starts one request after the window opens, so every
// client is measured at least once and the measured time stretches to cover it: the window's
// length is a target, never a condition for getting a result.
func (l *loader) closedLoop(ctx context.Context, n, maxTokens int, d time.Duration, do func(context.Context, request) error) (loopResult, error) {
	start := time.Now().Add(l.opts.Warmup)
	deadline := start.Add(d)
	var (
		mu      sync.Mutex
		lat     []float64
		lastEnd time.Time
	)
	g, gctx := errgroup.WithContext(ctx)
	// The CPU clock is read when the window opens, by a goroutine of its own.
	cpu0 := make(chan time.Duration, 1)
	g.Go(func() error {
		t := time.NewTimer(time.Until(start))
		defer t.Stop()
		select {
		case <-t.C:
			cpu0 <- processCPU()
			return nil
		case <-gctx.Done():
			cpu0 <- 0
			return nil
		}
	})
	vocab := min(l.m.Tokenizer().VocabSize(), l.m.Config().VocabSize)
	for i := range n {
		rng := rand.New(rand.NewPCG(l.opts.Seed, uint64(i)))
		r := request{prompt: make([]int32, l.opts.PromptLen), maxTokens: maxTokens}
		for j := range r.prompt {
			r.prompt[j] = int32(rng.IntN(vocab))
		}
		g.Go(func() error {
			var mine []float64
			var end time.Time
			for {
				t0 := time.Now()
				if !t0.Before(deadline) && len(mine) > 0 {
					break
				}
				if err := do(gctx, r); err != nil {
					return err
				}
				if !t0.Before(start) {
					end = time.Now()
					mine = append(mine, stats.Ms(end.Sub(t0)))
				}
			}
			mu.Lock()
			lat = append(lat, mine...)
			if end.After(lastEnd) {
				lastEnd = end
			}
			mu.Unlock()
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return loopResult{}, err
	}
	cpu := processCPU() - <-cpu0
	if len(lat) == 0 {
		return loopResult{}, fmt.Errorf("pdbench: no request completed in a %s window with %d clients", d, n)
	}
	return loopResult{lat: lat, elapsed: lastEnd.Sub(start), cpu: cpu}, nil
}
