package soak

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/faultproxy"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/stack"
)

// The stack's sizes and timeouts. The lease and the decoder TTL are short so that everything
// held for a reader that never came is back in the pool soon after the run; the proxy's cache
// TTL stays below the decoder's less the 5 s margin within which P declines a pull. D pins the
// blocks of every finished turn for the TTL and nothing reclaims them under pressure (as in
// vLLM); a conversation's last turn stays pinned until the TTL passes, so the pools are sized for
// the workload's steady state: up to ~30 conversations end every second, each pinning up to
// ~20 blocks for 8 s.
const (
	numBlocks     = 8192
	maxModelLen   = 4096
	leaseSeconds  = 5
	decoderTTL    = 8
	proxyCacheTTL = 2 * time.Second
	headerTimeout = 15 * time.Second
	idleTimeout   = 5 * time.Second
	clientTimeout = 60 * time.Second
)

// rig is the soak's stack — P and D with fault proxies in every path (restarts keep their
// engine_id and side-channel port, as a restarted `kvbridge serve` does), the multi-turn proxy
// and the single reference engine — with the workload's clients and the transfer counters of
// the incarnations closed so far.
type rig struct {
	*stack.Stack
	backend   string
	transport *http.Transport // the proxy's engine legs
	client    *http.Client    // the workload's client to the proxy
	refClient *http.Client    // to the reference engine

	mu   sync.Mutex
	past map[string]map[string]float64 // engine name → counters of its closed incarnations
}

func startRig(ctx context.Context, m *model.Model, policy connector.FailurePolicy, backend string, log *slog.Logger) (*rig, error) {
	tr := stack.NewTransport(64)
	tr.ResponseHeaderTimeout = headerTimeout
	// P caches no prefixes, so that every turn after the first pulls the conversation from D
	// (with its own prefix cache P would hold the history and pull nothing); D caches them.
	engine := func(name string, prefix bool) stack.EngineConfig {
		return stack.EngineConfig{EngineID: "soak-" + name, PrefixCaching: prefix, Faults: stack.FaultAll, KeepSideChannelPort: true}
	}
	s, err := stack.Start(ctx, stack.Config{
		Model: m, Mode: stack.Bidirectional, Policy: policy, Backend: backend, Lease: leaseSeconds * time.Second,
		DecoderTTL: decoderTTL * time.Second, NumBlocks: numBlocks, MaxModelLen: maxModelLen, Single: true,
		P: engine("P", false), D: engine("D", true), StatsInterval: time.Hour, Logger: log,
		Proxy: stack.ProxyConfig{CacheTTL: proxyCacheTTL, HeaderTimeout: headerTimeout, IdleTimeout: idleTimeout, Transport: tr},
	})
	if err != nil {
		return nil, fmt.Errorf("soak: %w", err)
	}
	return &rig{
		Stack: s, backend: backend, transport: tr, past: map[string]map[string]float64{},
		client:    &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}, Timeout: clientTimeout},
		refClient: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}, Timeout: clientTimeout},
	}, nil
}

// counters returns the transfer counters of the running incarnation of e, by metric name.
func counters(e *stack.Engine) map[string]float64 {
	st, err := e.Stats()
	if err != nil {
		return map[string]float64{}
	}
	return map[string]float64{
		"vllm:nixl_num_failed_transfers_total":           float64(st.FailedTransfers),
		"vllm:nixl_num_failed_notifications_total":       float64(st.FailedNotifications),
		"vllm:nixl_num_kv_expired_reqs_total":            float64(st.ExpiredRequests),
		"vllm:nixl_num_notifications_after_expiry_total": float64(st.NotificationsAfterExpiry),
	}
}

// totals returns the transfer counters of e summed over every incarnation.
func (s *rig) totals(e *stack.Engine) map[string]float64 {
	s.mu.Lock()
	out := maps.Clone(s.past[e.Name])
	s.mu.Unlock()
	if out == nil {
		out = map[string]float64{}
	}
	for k, v := range counters(e) {
		out[k] += v
	}
	return out
}

// restart closes e's running incarnation, keeping its counters, and starts a new one.
func (s *rig) restart(ctx context.Context, e *stack.Engine) error {
	s.mu.Lock()
	past := s.past[e.Name]
	if past == nil {
		past = map[string]float64{}
		s.past[e.Name] = past
	}
	for k, v := range counters(e) {
		past[k] += v
	}
	s.mu.Unlock()
	return s.Restart(ctx, e)
}

// path is one fault proxy of the stack, named for the report.
type path struct {
	name string
	fp   *faultproxy.Proxy
}

// paths returns the fault proxies in the stack's paths (over SHM the transfers bypass them).
func (s *rig) paths() []path {
	ps := []path{{"http-P", s.P.Faults.HTTP}, {"http-D", s.D.Faults.HTTP}, {"side-P", s.P.Faults.SideChannel}, {"side-D", s.D.Faults.SideChannel}}
	if s.backend == BackendTCP {
		ps = append(ps, path{"transfer-P", s.P.Faults.Transfer}, path{"transfer-D", s.D.Faults.Transfer})
	}
	return ps
}

// resetFaults turns every fault off.
func (s *rig) resetFaults() {
	for _, e := range []*stack.Engine{s.P, s.D} {
		for _, fp := range []*faultproxy.Proxy{e.Faults.HTTP, e.Faults.SideChannel, e.Faults.Transfer} {
			fp.Reset()
		}
	}
}

// closeIdle drops every idle keep-alive connection of the stack's clients.
func (s *rig) closeIdle() {
	s.client.CloseIdleConnections()
	s.refClient.CloseIdleConnections()
	s.transport.CloseIdleConnections()
}

// quiesce waits (at most d) until both engines are idle with every block free and no fault
// proxy has an open link, then takes a snapshot. It returns the snapshot even when the wait
// timed out, with an error saying what did not settle.
func (s *rig) quiesce(ctx context.Context, d time.Duration) (Snapshot, error) {
	deadline := time.Now().Add(d)
	var why string
	for {
		s.closeIdle()
		why = s.unsettled()
		if why == "" || time.Now().After(deadline) {
			break
		}
		select {
		case <-ctx.Done():
			return s.snapshot(), ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	// Goroutines of closed connections take a moment to end; give them a bounded chance.
	settle := time.Now().Add(2 * time.Second)
	prev := -1
	for time.Now().Before(settle) {
		n := runtime.NumGoroutine()
		if n == prev {
			break
		}
		prev = n
		time.Sleep(100 * time.Millisecond)
	}
	snap := s.snapshot()
	if why != "" {
		return snap, fmt.Errorf("the stack did not quiesce within %v: %s", d, why)
	}
	return snap, nil
}

// stats returns the Stats of e (zero if they cannot be read).
func stats(e *stack.Engine) instance.Stats {
	st, _ := e.Stats()
	return st
}

// unsettled says what still moves, or "".
func (s *rig) unsettled() string {
	var parts []string
	for _, e := range []*stack.Engine{s.P, s.D} {
		st := stats(e)
		if st.Running+st.Waiting+st.Held > 0 || st.FreeBlocks != st.NumBlocks {
			parts = append(parts, fmt.Sprintf("%s: %d running, %d waiting, %d held, %d of %d blocks free",
				e.Name, st.Running, st.Waiting, st.Held, st.FreeBlocks, st.NumBlocks))
		}
	}
	for _, p := range s.paths() {
		if n := p.fp.Stats().Open; n > 0 && strings.HasPrefix(p.name, "http") {
			parts = append(parts, fmt.Sprintf("%s: %d open connections", p.name, n))
		}
	}
	return strings.Join(parts, "; ")
}

// snapshot measures the process and the pools.
func (s *rig) snapshot() Snapshot {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	snap := Snapshot{HeapAllocBytes: ms.HeapAlloc, Goroutines: runtime.NumGoroutine(), RSSBytes: rss(),
		FreeBlocks: map[string]int{}, NumBlocks: map[string]int{}}
	for _, e := range []*stack.Engine{s.P, s.D} {
		st := stats(e)
		snap.FreeBlocks[e.Name] = st.FreeBlocks
		snap.NumBlocks[e.Name] = st.NumBlocks
	}
	return snap
}

// rss returns the resident set size from /proc/self/statm (0 where unavailable).
func rss() uint64 {
	data, err := os.ReadFile("/proc/self/statm")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(data))
	if len(f) < 2 {
		return 0
	}
	pages, _ := strconv.ParseUint(f[1], 10, 64)
	return pages * uint64(os.Getpagesize())
}

// close stops everything the stack started.
func (s *rig) close() {
	_ = s.Close()
	s.closeIdle()
}
