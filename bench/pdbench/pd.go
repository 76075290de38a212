package pdbench

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/kvbridge/kvbridge/apiclient"
	"github.com/kvbridge/kvbridge/engine"
	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/proxy"
	"github.com/kvbridge/kvbridge/stack"
	"github.com/kvbridge/kvbridge/stats"
)

// PDOptions configure RunPD. Zero values take the defaults noted on each field.
type PDOptions struct {
	// Model is the model every engine serves (default kvbridge/small).
	Model string
	// PromptLens are the prompt lengths in tokens, one row each (default 512, 1024, 2048, 4096).
	PromptLens []int
	// Iters is the number of measured requests per prompt length and path, after one warm-up
	// (default 3); the rows hold medians.
	Iters int
	// Backend is the transfer backend P and D are restricted to: "SHM" (default) or "TCP".
	Backend string
	// BlockSize is the KV block size in tokens (default kvcache.DefaultBlockSize).
	BlockSize int
	// Seed chooses the prompts (default 1).
	Seed uint64
	// Progress, if non-nil, receives one line per phase.
	Progress io.Writer
	// Logger receives the engines' and the proxy's logs; nil discards.
	Logger *slog.Logger
	// Hosts runs the single engine, P and D as kvbridge processes on hosts of their own
	// (network namespaces joined by a bridge, package netns; root is needed), with the proxy
	// in this process on the client's host; P and D use TCP, and the ceiling is raw TCP
	// streams from P's host to D's instead of a memcpy.
	Hosts bool
	// Command is how Hosts starts kvbridge: the program and leading arguments (default this
	// process's executable).
	Command []string
	// TransferModes are the ways P's KV reaches D, one set of rows each, each on engines and a
	// proxy of their own (default TransferPull): TransferPull, TransferPush and
	// TransferPushLayered. Engines that refuse a mode's connector configuration give one row
	// saying so (PDRow.Unsupported) instead of figures.
	TransferModes []string
	// PrefillTP and DecodeTP are P's and D's --tensor-parallel-size (default 1 each; the single
	// engine always runs TP 1): P/D between TP sizes, D's ranks reading their heads from P's.
	// Not with Hosts.
	PrefillTP, DecodeTP int
}

// The transfer modes of PDOptions.TransferModes.
const (
	// TransferPull is the NixlConnector: P's leg, then D's, D READs P's blocks.
	TransferPull = "pull"
	// TransferPush is the NixlPushConnector on P and D with the proxy's concurrent push flow:
	// both legs at once, D registers its blocks, P WRITEs the KV when its prefill ends.
	TransferPush = "push"
	// TransferPushLayered is TransferPush with P writing each layer's KV as soon as it is
	// computed: kv_connector_extra_config.push_layerwise on P.
	TransferPushLayered = "push-layered"
)

// transferConfigs are each mode's --kv-transfer-config on P and D (beyond kv_role and the
// backends) and the proxy's transfer mode.
var transferConfigs = map[string]struct {
	kv    map[string]any // nil: the NixlConnector's defaults
	proxy proxy.TransferMode
}{
	TransferPull: {nil, proxy.TransferPull},
	TransferPush: {map[string]any{"kv_connector": proxy.PushConnector}, proxy.TransferPush},
	TransferPushLayered: {map[string]any{"kv_connector": proxy.PushConnector,
		"kv_connector_extra_config": map[string]any{"push_layerwise": true}}, proxy.TransferPush},
}

// pdStack is what RunPD measures: a single engine, and P and D behind the one-way proxy.
type pdStack interface {
	// client is the HTTP client that reaches the single engine and the proxy.
	client() *http.Client
	urls() (single, proxy string)
	// engineTTFT returns the engines' summed engine-side TTFT so far.
	engineTTFT(ctx context.Context) (single, p, d time.Duration, err error)
	// takeTransfers returns the KV transfers since the previous call: D's reads (pull), P's
	// writes (push).
	takeTransfers(ctx context.Context) (transfers, error)
	// settle waits until P holds no KV blocks for the connector: D released them (pull), or
	// P's writes ended (push) — P counts a transfer before it lets go of the blocks, and may
	// do so after D has answered.
	settle(ctx context.Context) error
	// legs returns (and forgets) the proxy's legs of a request.
	legs(id string) (legTimes, bool)
	// dStepTokens returns the tokens D's forward steps computed so far.
	dStepTokens(ctx context.Context) (int64, error)
	// engineCPU returns the CPU time the single engine's, P's and D's processes used so far;
	// ok is false when they share one process (no --hosts).
	engineCPU() (single, p, d time.Duration, ok bool)
	// ceiling measures how fast n bytes could move at best (right after each measured request).
	ceiling(ctx context.Context, n int64) (ceilings, error)
	Close() error
}

// ceilings are the rates, in GB/s, of moving a transfer's bytes without the transfer engine:
// best is the ceiling; oneConn and manyConns the raw TCP streams over one connection and over
// as many as the transfer engine opens (hosts only).
type ceilings struct {
	best, oneConn, manyConns float64
}

// transfers sums the KV transfers of an interval.
type transfers struct {
	n, failed int64
	dur       time.Duration
	bytes     int64
}

func (o *PDOptions) defaults() error {
	if o.Model == "" {
		o.Model = model.Small
	}
	if len(o.PromptLens) == 0 {
		o.PromptLens = []int{512, 1024, 2048, 4096}
	}
	for _, l := range o.PromptLens {
		if l < 2 {
			return fmt.Errorf("pdbench: prompt length %d: at least 2 tokens are needed", l)
		}
	}
	if o.Iters <= 0 {
		o.Iters = 3
	}
	if len(o.TransferModes) == 0 {
		o.TransferModes = []string{TransferPull}
	}
	for _, mode := range o.TransferModes {
		if _, ok := transferConfigs[mode]; !ok {
			return fmt.Errorf("pdbench: transfer mode %q: want %s, %s or %s", mode, TransferPull, TransferPush, TransferPushLayered)
		}
	}
	if o.Backend == "" {
		o.Backend = "SHM"
		if o.Hosts {
			o.Backend = "TCP"
		}
	}
	switch o.Backend = strings.ToUpper(o.Backend); o.Backend {
	case "SHM", "TCP":
	default:
		return fmt.Errorf("pdbench: backend %q: SHM or TCP", o.Backend)
	}
	if o.Hosts && o.Backend != "TCP" {
		return fmt.Errorf("pdbench: backend %s cannot cross hosts: use TCP", o.Backend)
	}
	if o.BlockSize <= 0 {
		o.BlockSize = kvcache.DefaultBlockSize
	}
	o.PrefillTP, o.DecodeTP = max(o.PrefillTP, 1), max(o.DecodeTP, 1)
	if o.Seed == 0 {
		o.Seed = 1
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return nil
}

// PDRow is one transfer mode's and prompt length's figures: medians over the measured
// iterations. The JSON fields up to ratio are the table's columns (unsupported aside); the rest
// break the P/D TTFT down.
type PDRow struct {
	// Mode is the transfer mode (PDOptions.TransferModes). Unsupported, when set, says why the
	// engines refused the mode's configuration; the row then holds no figures.
	Mode         string  `json:"transfer_mode"`
	Unsupported  string  `json:"unsupported,omitempty"`
	PrefillTP    int     `json:"prefill_tp"` // P's and D's tensor-parallel sizes (PDOptions)
	DecodeTP     int     `json:"decode_tp"`
	PromptLen    int     `json:"prompt_len"`
	TTFTSingleMs float64 `json:"ttft_single_ms"` // non-stream max_tokens=1 answer of the single engine
	TTFTPDMs     float64 `json:"ttft_pd_ms"`     // the same request through the proxy (P then D)
	// Overhead is ttft_pd ÷ ttft_single − 1, a fraction (0.05 = 5%).
	Overhead float64 `json:"overhead"`
	// OverheadPaired is the median over the requests of ttft_pd ÷ ttft_single − 1, each P/D
	// request paired with the single-engine request sent beside it (the two alternate): drift on
	// a shared machine that moves both alike cancels, where Overhead compares two medians.
	OverheadPaired float64 `json:"overhead_paired"`
	// SingleCPUMs, PCPUMs and DCPUMs are the CPU time (ms) the single engine's process used
	// during its request and P's and D's processes during the P/D request (--hosts; -1
	// otherwise): on hosts that share the machine's cores, P/D's CPU beyond the single engine's
	// (the transfer's send and receive, D's request) is time P's prefill may lose.
	SingleCPUMs float64 `json:"single_cpu_ms"`
	PCPUMs      float64 `json:"p_cpu_ms"`
	DCPUMs      float64 `json:"d_cpu_ms"`
	// TransferMs is D's KV read of the request (NIXL xferDuration); TransferShare that ÷ ttft_pd
	// of the same request, a fraction.
	TransferMs    float64 `json:"transfer_ms"`
	TransferShare float64 `json:"transfer_share"`
	// HiddenShare is the share of the transfer hidden under P's compute. A serial flow (pull:
	// D's leg leaves after P's answer) hides nothing: 0. With the legs overlapping (push) it is
	// 1 − exposed ÷ transfer, exposed being what D still spent after P's answer beyond its
	// one-token step (d_end − p_end − recompute_1tok, within [0, transfer]); the proxy's and
	// D's HTTP time after P's answer count as exposed, so it is a lower bound. −1 when no
	// request's P answer was traced.
	HiddenShare float64 `json:"hidden_share"`
	// TransferGBps is bytes ÷ transfer duration; CeilingGBps the same bytes moved by the
	// ceiling measured in the same run (Ceiling: "memcpy", a single-goroutine memcpy,
	// kernel.MemcpyGBps; or "tcp_stream" with Hosts, raw TCP streams from P's host to D's:
	// requests, then as many bytes), the median over the iterations, each measured right after
	// its request; Ratio the median of each request's transfer rate ÷ the ceiling measured right
	// after it (paired, so that load from elsewhere on a shared machine cancels out).
	TransferGBps float64 `json:"transfer_gbps"`
	CeilingGBps  float64 `json:"ceiling_gbps"`
	Ratio        float64 `json:"ratio"`
	Ceiling      string  `json:"ceiling"`
	// TCP1ConnGBps and TCP4ConnGBps are the raw TCP streams the "tcp_stream" ceiling is the
	// better of: one connection, and four (as many as the transfer engine opens to a peer).
	TCP1ConnGBps float64 `json:"tcp_1conn_gbps,omitempty"`
	TCP4ConnGBps float64 `json:"tcp_4conn_gbps,omitempty"`
	// Hosts tells that P, D and the single engine ran on hosts of their own.
	Hosts bool `json:"hosts,omitempty"`

	Backend       string `json:"backend"`
	Iters         int    `json:"iters"`
	TransferBytes int64  `json:"transfer_bytes"`
	// Where the P/D TTFT goes, as the proxy's own transport saw the legs:
	// ProxyInMs: client send → P leg sent (client hop, body read and decode);
	// PLegMs: P leg sent → P's answer read (P's prefill with max_tokens=1);
	// ProxyMidMs: P's answer read → D leg sent (params decoded, D's body encoded);
	// DLegMs: D leg sent → D's answer read (admission, handshake if any, the read, the
	// recompute of the last prompt token, sampling); ProxyOutMs: D's answer read → client has it.
	ProxyInMs  float64 `json:"proxy_in_ms"`
	PLegMs     float64 `json:"p_leg_ms"`
	ProxyMidMs float64 `json:"proxy_mid_ms"`
	DLegMs     float64 `json:"d_leg_ms"`
	ProxyOutMs float64 `json:"proxy_out_ms"`
	// DOtherMs is d_leg − transfer: D's time outside the read.
	DOtherMs float64 `json:"d_other_ms"`
	// RecomputeMs is one forward step of the last prompt token over the prompt's context on
	// freshly allocated blocks, timed on its own in this process: what D's recompute of that
	// token costs, including packing the whole context's KV for attention (nothing is packed for
	// blocks a transfer just filled). RecomputeWarmMs is the same step with the context already
	// packed (a steady decode step); the difference is the packing. Both are 0 for a request D
	// started from P's first token (push: D's steps computed no token for it).
	RecomputeMs     float64 `json:"recompute_ms"`
	RecomputeWarmMs float64 `json:"recompute_warm_ms"`
	// PLegOverSingleMs is p_leg − ttft_single: what P costs beyond a single engine's prefill
	// (two separate requests, so it carries the machine's noise).
	PLegOverSingleMs float64 `json:"p_leg_over_single_ms"`
	// AddedMs is ttft_pd − p_leg within one request: everything P/D adds to P's prefill (proxy
	// hops and D's leg); AddedShare is that ÷ p_leg, the overhead measured inside one request,
	// free of the noise between two requests.
	AddedMs    float64 `json:"added_ms"`
	AddedShare float64 `json:"added_share"`
	// Engine-side TTFTs (vllm:time_to_first_token_seconds of one request: engine accepted →
	// first output): single engine, P, D. DHTTPMs = d_leg − d_engine (HTTP, JSON, validation);
	// DSchedMs = d_engine − transfer − recompute (admission, connector load set-up, the
	// generation check, hand-offs between goroutines, sampling).
	SingleEngineMs float64 `json:"single_engine_ms"`
	PEngineMs      float64 `json:"p_engine_ms"`
	DEngineMs      float64 `json:"d_engine_ms"`
	DHTTPMs        float64 `json:"d_http_ms"`
	DSchedMs       float64 `json:"d_sched_ms"`
}

// pdSample is one measured iteration.
type pdSample struct {
	single, pd, transfer  time.Duration
	singleEng, pEng, dEng time.Duration // engine-side TTFTs
	bytes                 int64
	dComputed             int64 // tokens D's steps computed for the request (0: it started from P's token)
	// CPU time of the engines' processes during the requests (--hosts; cpuOK false otherwise)
	singleCPU, pCPU, dCPU time.Duration
	cpuOK                 bool
	legs                  legTimes
	t0, t1                time.Time
}

// RunPD starts a single engine, a prefiller, a decoder and the one-way proxy in this process on
// one opened model and measures, per prompt length, the time to the first token through the
// proxy and on the single engine, and D's KV read against a memcpy ceiling.
func RunPD(ctx context.Context, opts PDOptions) ([]PDRow, error) {
	if err := opts.defaults(); err != nil {
		return nil, err
	}
	m, err := stack.OpenModel(ctx, opts.Model, opts.Progress)
	if err != nil {
		return nil, fmt.Errorf("pdbench: %w", err)
	}
	defer m.Close()
	bs := opts.BlockSize
	longest := slices.Max(opts.PromptLens)
	maxLen := (longest+1+bs-1)/bs*bs + bs
	if mp := m.Config().MaxPositionEmbeddings; maxLen > mp {
		return nil, fmt.Errorf("pdbench: a %d-token prompt exceeds the model's %d positions", longest, mp)
	}
	var tpModels map[int]*model.Model // with --hosts, the engine processes open their own
	if !opts.Hosts {
		if tpModels, err = openTPModels(ctx, opts, m); err != nil {
			return nil, err
		}
	}
	defer func() {
		for _, tm := range tpModels {
			tm.Close()
		}
	}()
	var rows []PDRow
	for _, mode := range opts.TransferModes {
		mrows, err := runMode(ctx, opts, m, tpModels, mode, maxLen, longest)
		rows = append(rows, mrows...)
		if err != nil {
			return rows, err
		}
	}
	return rows, nil
}

// openTPModels opens opts.Model again at P's and D's tensor-parallel sizes above 1 (m serves
// TP 1), by size.
func openTPModels(ctx context.Context, opts PDOptions, m *model.Model) (map[int]*model.Model, error) {
	out := map[int]*model.Model{1: m}
	for _, tp := range []int{opts.PrefillTP, opts.DecodeTP} {
		if out[tp] != nil {
			continue
		}
		stack.Printer(opts.Progress)("loading %s at tensor-parallel size %d", opts.Model, tp)
		tm, err := model.Open(ctx, opts.Model, model.OpenOptions{TensorParallelSize: tp})
		if err != nil {
			for size, o := range out {
				if size != 1 {
					o.Close()
				}
			}
			return nil, fmt.Errorf("pdbench: open %s at TP %d: %w", opts.Model, tp, err)
		}
		out[tp] = tm
	}
	delete(out, 1)
	return out, nil
}

// runMode measures every prompt length in one transfer mode, on engines and a proxy of its own;
// tpModels holds the model at P's and D's TP sizes above 1.
func runMode(ctx context.Context, opts PDOptions, m *model.Model, tpModels map[int]*model.Model, mode string, maxLen, longest int) ([]PDRow, error) {
	progress := stack.Printer(opts.Progress)
	bs := opts.BlockSize
	blocksPerSeq := maxLen / bs
	tc := transferConfigs[mode]
	var kv []byte
	if tc.kv != nil {
		kv, _ = json.Marshal(tc.kv)
	}
	var (
		st  pdStack
		err error
	)
	if opts.Hosts {
		progress("%s: starting a single engine, P (TP %d) and D (TP %d) (%s) on hosts of their own, and the proxy", mode, opts.PrefillTP, opts.DecodeTP, opts.Backend)
		st, err = startHostStack(ctx, hostStackConfig{
			command: opts.Command, model: opts.Model, blockSize: bs, numBlocks: 2*blocksPerSeq + 8,
			maxModelLen: maxLen, log: opts.Logger, kv: tc.kv, transferMode: tc.proxy,
			prefillTP: opts.PrefillTP, decodeTP: opts.DecodeTP,
		})
	} else {
		progress("%s: starting a single engine, P (TP %d) and D (TP %d) (%s) and the proxy", mode, opts.PrefillTP, opts.DecodeTP, opts.Backend)
		st, err = startCluster(ctx, stack.Config{
			Model: m, Backend: opts.Backend, BlockSize: bs, NumBlocks: 2*blocksPerSeq + 8,
			MaxModelLen: maxLen, Logger: opts.Logger,
			P:     stack.EngineConfig{KVTransferConfig: kv, Model: tpModels[opts.PrefillTP]},
			D:     stack.EngineConfig{KVTransferConfig: kv, Model: tpModels[opts.DecodeTP]},
			Proxy: stack.ProxyConfig{TransferMode: tc.proxy},
		})
	}
	if err != nil && mode != TransferPull {
		// The engines refuse the mode's connector configuration (before it lands, or a build
		// without it): one row saying so, and the other modes still run.
		progress("%s: unsupported by engines: %v", mode, err)
		return []PDRow{{Mode: mode, Unsupported: err.Error(), Backend: opts.Backend, Hosts: opts.Hosts, PrefillTP: opts.PrefillTP, DecodeTP: opts.DecodeTP}}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("pdbench: %w", err)
	}
	defer st.Close()
	hc := st.client()
	defer hc.CloseIdleConnections()
	b := &pdBench{opts: opts, m: m, st: st, hc: hc, mode: mode}
	if b.rc, err = newRecomputer(m, bs, longest); err != nil {
		return nil, err
	}

	rows := make([]PDRow, 0, len(opts.PromptLens))
	for _, l := range opts.PromptLens {
		progress("%s, prompt %d tokens: 1 warm-up + %d measured requests each way", mode, l, opts.Iters)
		row, err := b.row(ctx, l)
		if err != nil {
			return rows, fmt.Errorf("%s: %w", mode, err)
		}
		rows = append(rows, row)
	}
	return rows, nil
}

// pdBench is one RunPD's state.
type pdBench struct {
	opts PDOptions
	m    *model.Model
	st   pdStack
	hc   *http.Client
	rc   *recomputer
	mode string
	seq  uint64 // requests sent, for distinct prompts and ids
}

// prompt returns a new random token-id prompt: every request's prompt differs, so no cache
// could help (prefix caching is off on every engine anyway).
func (b *pdBench) prompt(n int) []int32 {
	b.seq++
	rng := rand.New(rand.NewPCG(b.opts.Seed, b.seq))
	vocab := min(b.m.Tokenizer().VocabSize(), b.m.Config().VocabSize)
	p := make([]int32, n)
	for i := range p {
		p[i] = int32(rng.IntN(vocab))
	}
	return p
}

func (b *pdBench) body(prompt []int32) map[string]any {
	return map[string]any{"model": b.m.Name(), "prompt": prompt, "max_tokens": 1, "temperature": 0}
}

// single times one request on the single engine: client-side and engine-side TTFT.
func (b *pdBench) single(ctx context.Context, l int) (client, eng, cpu time.Duration, err error) {
	body := b.body(b.prompt(l))
	single, _ := b.st.urls()
	e0, _, _, err := b.st.engineTTFT(ctx)
	if err != nil {
		return 0, 0, 0, err
	}
	c0, _, _, _ := b.st.engineCPU()
	t0 := time.Now()
	if err := post(ctx, b.hc, single+"/v1/completions", "", body); err != nil {
		return 0, 0, 0, err
	}
	client = time.Since(t0)
	c1, _, _, _ := b.st.engineCPU()
	e1, _, _, err := b.st.engineTTFT(ctx)
	return client, e1 - e0, c1 - c0, err
}

// post sends body to url (with X-Request-Id reqID unless empty) and checks that the answer is
// a whole 200.
func post(ctx context.Context, hc *http.Client, url, reqID string, body map[string]any) error {
	var h http.Header
	if reqID != "" {
		h = http.Header{"X-Request-Id": {reqID}}
	}
	r, err := apiclient.Post(ctx, hc, url, body, h)
	if err != nil {
		return fmt.Errorf("pdbench: %w", err)
	}
	if err := r.Check(url); err != nil {
		return fmt.Errorf("pdbench: %w", err)
	}
	return nil
}

// pd times one request through the proxy and collects its legs and D's transfer.
func (b *pdBench) pd(ctx context.Context, l int) (pdSample, error) {
	body := b.body(b.prompt(l))
	id := fmt.Sprintf("pdbench-%d-%d", l, b.seq)
	if _, err := b.st.takeTransfers(ctx); err != nil { // drop anything not of this request
		return pdSample{}, err
	}
	_, p0, d0, err := b.st.engineTTFT(ctx)
	if err != nil {
		return pdSample{}, err
	}
	c0, err := b.st.dStepTokens(ctx)
	if err != nil {
		return pdSample{}, err
	}
	_, proxyURL := b.st.urls()
	_, p0cpu, d0cpu, _ := b.st.engineCPU()
	s := pdSample{t0: time.Now()}
	if err := post(ctx, b.hc, proxyURL+"/v1/completions", id, body); err != nil {
		return pdSample{}, err
	}
	s.t1 = time.Now()
	_, p1cpu, d1cpu, cpuOK := b.st.engineCPU()
	s.pCPU, s.dCPU, s.cpuOK = p1cpu-p0cpu, d1cpu-d0cpu, cpuOK
	s.pd = s.t1.Sub(s.t0)
	_, p1, d1, err := b.st.engineTTFT(ctx)
	if err != nil {
		return pdSample{}, err
	}
	s.pEng, s.dEng = p1-p0, d1-d0
	c1, err := b.st.dStepTokens(ctx)
	if err != nil {
		return pdSample{}, err
	}
	s.dComputed = c1 - c0
	if err := b.st.settle(ctx); err != nil {
		return pdSample{}, err
	}
	xf, err := b.st.takeTransfers(ctx)
	if err != nil {
		return pdSample{}, err
	}
	if xf.n == 0 {
		return pdSample{}, fmt.Errorf("pdbench: D recorded no KV transfer for a %d-token prompt (failed transfers %d)", l, xf.failed)
	}
	s.transfer, s.bytes = xf.dur, xf.bytes
	var ok bool
	if s.legs, ok = b.st.legs(id); !ok || s.legs.pStart.IsZero() || s.legs.dEnd.IsZero() || (s.legs.pEnd.IsZero() && b.mode == TransferPull) {
		return pdSample{}, fmt.Errorf("pdbench: the proxy's legs of request %s were not traced", id)
	}
	return s, nil
}

// row measures one prompt length.
func (b *pdBench) row(ctx context.Context, l int) (PDRow, error) {
	if _, _, _, err := b.single(ctx, l); err != nil { // warm-up (and, the first time, the handshake)
		return PDRow{}, err
	}
	if _, err := b.pd(ctx, l); err != nil {
		return PDRow{}, err
	}
	var single, pd, paired, xfer, share, gbps, in, pleg, mid, dleg, out, dother, pover, added, addedShare,
		singleEng, pEng, dEng, dHTTP, dSched []float64
	var bytes int64
	var recompute, recomputeWarm, ceilBest, ceilOne, ceilMany, ratio, hidden []float64
	var singleCPU, pCPU, dCPU []float64
	for i := range b.opts.Iters {
		var (
			s          pdSample
			err        error
			sc, se, su time.Duration
		)
		// Alternate the order so that drift on a shared machine favours neither path.
		if i%2 == 0 {
			if sc, se, su, err = b.single(ctx, l); err == nil {
				s, err = b.pd(ctx, l)
			}
		} else {
			if s, err = b.pd(ctx, l); err == nil {
				sc, se, su, err = b.single(ctx, l)
			}
		}
		if err != nil {
			return PDRow{}, err
		}
		s.single, s.singleEng, s.singleCPU = sc, se, su
		if s.cpuOK {
			singleCPU, pCPU, dCPU = append(singleCPU, stats.Ms(s.singleCPU)), append(pCPU, stats.Ms(s.pCPU)), append(dCPU, stats.Ms(s.dCPU))
		}
		// D's recompute, timed alone right after the request so that both see the same load.
		// The ceiling too, on the same bytes: noise from a shared machine hits both alike.
		c, err := b.st.ceiling(ctx, s.bytes)
		if err != nil {
			return PDRow{}, err
		}
		ceilBest, ceilOne, ceilMany = append(ceilBest, c.best), append(ceilOne, c.oneConn), append(ceilMany, c.manyConns)
		ratio = append(ratio, float64(s.bytes)/s.transfer.Seconds()/1e9/c.best)
		cold, warm, err := b.rc.time(ctx, l, 1)
		if err != nil {
			return PDRow{}, err
		}
		if s.dComputed == 0 {
			cold, warm = 0, 0 // D started from P's first token: it recomputed nothing
		}
		recompute = append(recompute, stats.Ms(cold))
		recomputeWarm = append(recomputeWarm, stats.Ms(warm))
		switch {
		case s.legs.pEnd.IsZero() || s.transfer <= 0:
		case !s.legs.dStart.Before(s.legs.pEnd):
			hidden = append(hidden, 0) // D's leg left after P's answer: its transfer too
		default:
			exposed := min(max(s.legs.dEnd.Sub(s.legs.pEnd)-cold, 0), s.transfer)
			hidden = append(hidden, 1-float64(exposed)/float64(s.transfer))
		}
		if s.legs.pEnd.IsZero() {
			s.legs.pEnd = s.legs.dEnd // P's answer not traced: read no later than D's
		}
		pLeg := s.legs.pEnd.Sub(s.legs.pStart)
		dLeg := s.legs.dEnd.Sub(s.legs.dStart)
		added = append(added, stats.Ms(s.pd-pLeg))
		addedShare = append(addedShare, float64(s.pd-pLeg)/float64(pLeg))
		singleEng = append(singleEng, stats.Ms(s.singleEng))
		pEng = append(pEng, stats.Ms(s.pEng))
		dEng = append(dEng, stats.Ms(s.dEng))
		dHTTP = append(dHTTP, stats.Ms(dLeg-s.dEng))
		dSched = append(dSched, stats.Ms(s.dEng-s.transfer-cold))
		single = append(single, stats.Ms(s.single))
		pd = append(pd, stats.Ms(s.pd))
		paired = append(paired, float64(s.pd)/float64(s.single)-1)
		xfer = append(xfer, stats.Ms(s.transfer))
		share = append(share, float64(s.transfer)/float64(s.pd))
		gbps = append(gbps, float64(s.bytes)/s.transfer.Seconds()/1e9)
		in = append(in, stats.Ms(s.legs.pStart.Sub(s.t0)))
		pleg = append(pleg, stats.Ms(s.legs.pEnd.Sub(s.legs.pStart)))
		mid = append(mid, stats.Ms(s.legs.dStart.Sub(s.legs.pEnd)))
		dleg = append(dleg, stats.Ms(s.legs.dEnd.Sub(s.legs.dStart)))
		out = append(out, stats.Ms(s.t1.Sub(s.legs.dEnd)))
		dother = append(dother, stats.Ms(s.legs.dEnd.Sub(s.legs.dStart)-s.transfer))
		pover = append(pover, stats.Ms(s.legs.pEnd.Sub(s.legs.pStart)-s.single))
		bytes = max(bytes, s.bytes)
	}
	kind := "memcpy"
	if b.opts.Hosts {
		kind = "tcp_stream"
	}
	r := PDRow{
		Mode: b.mode, PrefillTP: b.opts.PrefillTP, DecodeTP: b.opts.DecodeTP, PromptLen: l, HiddenShare: -1, TTFTSingleMs: stats.Median(single), TTFTPDMs: stats.Median(pd),
		TransferMs: stats.Median(xfer), TransferShare: stats.Median(share), TransferGBps: stats.Median(gbps),
		CeilingGBps: stats.Median(ceilBest), Ceiling: kind, Hosts: b.opts.Hosts,
		TCP1ConnGBps: stats.Median(ceilOne), TCP4ConnGBps: stats.Median(ceilMany),
		Backend: b.opts.Backend, Iters: b.opts.Iters, TransferBytes: bytes,
		ProxyInMs: stats.Median(in), PLegMs: stats.Median(pleg), ProxyMidMs: stats.Median(mid), DLegMs: stats.Median(dleg),
		ProxyOutMs: stats.Median(out), DOtherMs: stats.Median(dother), RecomputeMs: stats.Median(recompute), RecomputeWarmMs: stats.Median(recomputeWarm), PLegOverSingleMs: stats.Median(pover),
		AddedMs: stats.Median(added), AddedShare: stats.Median(addedShare),
		SingleEngineMs: stats.Median(singleEng), PEngineMs: stats.Median(pEng), DEngineMs: stats.Median(dEng),
		DHTTPMs: stats.Median(dHTTP), DSchedMs: stats.Median(dSched),
	}
	r.Overhead = r.TTFTPDMs/r.TTFTSingleMs - 1
	r.OverheadPaired = stats.Median(paired)
	r.SingleCPUMs, r.PCPUMs, r.DCPUMs = -1, -1, -1
	if len(pCPU) > 0 {
		r.SingleCPUMs, r.PCPUMs, r.DCPUMs = stats.Median(singleCPU), stats.Median(pCPU), stats.Median(dCPU)
	}
	if len(hidden) > 0 {
		r.HiddenShare = stats.Median(hidden)
	}
	r.Ratio = stats.Median(ratio)
	return r, nil
}

// recomputer times D's recompute of a prompt's last token: one forward step of one token at
// position len−1 over a KV pool of its own (whatever the KV holds, the work is the same). It
// times a cold step (blocks freshly allocated, as after a transfer) and a warm one (the same step
// again); the model packs the context's KV for attention on every step, so the two should match
// and their difference, reported as "(packing)", should be noise.
type recomputer struct {
	m      *model.Model
	bs     int
	pool   *kvcache.Pool
	blocks []int32
	logits []float32
}

func newRecomputer(m *model.Model, blockSize, longest int) (*recomputer, error) {
	geo := engine.KVGeometry(m, blockSize)
	n := (longest + blockSize - 1) / blockSize
	pool, err := kvcache.NewPool(kvcache.AlignedMemory(n*geo.BlockBytes()), kvcache.PoolConfig{Geometry: geo, NumBlocks: n})
	if err != nil {
		return nil, fmt.Errorf("pdbench: %w", err)
	}
	blocks, err := pool.Allocate(n)
	if err != nil {
		return nil, fmt.Errorf("pdbench: %w", err)
	}
	return &recomputer{m: m, bs: blockSize, pool: pool, blocks: blocks, logits: make([]float32, m.Config().VocabSize)}, nil
}

// time returns the medians of reps cold and reps warm one-token steps at position l−1.
func (r *recomputer) time(ctx context.Context, l, reps int) (cold, warm time.Duration, err error) {
	var cs, ws []float64
	for range reps {
		// New generations: nothing packed for these blocks, as on D after a transfer.
		r.pool.Free(r.blocks...)
		if r.blocks, err = r.pool.Allocate(len(r.blocks)); err != nil {
			return 0, 0, fmt.Errorf("pdbench: %w", err)
		}
		seq := []model.Seq{{Tokens: []int32{1}, Start: l - 1, Blocks: r.blocks[:(l+r.bs-1)/r.bs], Logits: r.logits}}
		for i := range 2 {
			t0 := time.Now()
			if err := r.m.Forward(ctx, r.pool, r.bs, seq); err != nil {
				return 0, 0, fmt.Errorf("pdbench: %w", err)
			}
			if i == 0 {
				cs = append(cs, float64(time.Since(t0)))
			} else {
				ws = append(ws, float64(time.Since(t0)))
			}
		}
	}
	return time.Duration(stats.Median(cs)), time.Duration(stats.Median(ws)), nil
}
