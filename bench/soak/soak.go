// Package soak is kvbridge's soak run (`kvbridge bench soak`): it drives a multi-turn chat
// workload through the multi-turn proxy in front of a prefiller and a decoder with bidirectional
// KV transfer — all in this process, on 127.0.0.1 — while injecting faults at random from a seed:
// latency, stalls, connection cuts and refusals on every path (the proxy's HTTP legs, both side
// channels, both transfer paths, each through a fault proxy), and engine restarts (Close and a
// new instance with the same engine_id and side-channel port). Every answer is compared with a
// single-instance engine given the same messages and sampling; the report counts requests,
// errors by class and wrong outputs, and compares heap, goroutines and free KV blocks before
// and after, once the stack has quiesced.
//
// See docs/architecture.md for where the package sits among kvbridge's packages.
package soak

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"runtime"
	"sync"
	"time"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/stack"
)

// ErrConfig reports soak options that cannot work.
var ErrConfig = errors.New("soak: invalid options")

// Fault kinds, as named in Config.Faults and in the report.
const (
	FaultLatency    = "latency"     // added latency on one direction of a path, for a while
	FaultStall      = "stall"       // one direction of a path stops, for a while
	FaultCut        = "cut"         // every open connection of a path is closed
	FaultCloseAfter = "close_after" // the next connection to carry N more bytes is cut after them
	FaultRefuse     = "refuse"      // a path refuses new connections, for a while
	FaultRestart    = "restart"     // P or D is closed and started again with the same engine_id
)

// AllFaults lists every fault kind. Corrupted bytes are not among them: neither HTTP nor the
// transfer frames carry a checksum of their payload, so a flipped byte inside a body is not
// detected by design (docs/reliability.md).
func AllFaults() []string {
	return []string{FaultLatency, FaultStall, FaultCut, FaultCloseAfter, FaultRefuse, FaultRestart}
}

// The transfer backends a soak can run on.
const (
	// BackendTCP sends every transfer through the fault proxies (the default).
	BackendTCP = "TCP"
	// BackendSHM copies through shared memory; the transfer paths then bypass the fault
	// proxies, and only the HTTP legs, the side channels and restarts are faulted.
	BackendSHM = "SHM"
)

// Config configures a soak run. Zero values take the defaults.
type Config struct {
	// Duration is how long the workload and the faults run (default 1 minute).
	Duration time.Duration
	// Seed seeds the workload and the faults (0 is a valid seed).
	Seed int64
	// Concurrency is the number of conversations in flight (default 4).
	Concurrency int
	// Policy is kv_load_failure_policy on both engines (default recompute).
	Policy connector.FailurePolicy
	// Backend is the transfer backend of both engines: BackendTCP (default) or BackendSHM.
	Backend string
	// FaultInterval is the mean time between two faults (default 2 s); faults follow one another.
	FaultInterval time.Duration
	// Faults are the kinds injected (default AllFaults).
	Faults []string
	// Model is the model served (default kvbridge/tiny).
	Model string
	// Progress, when set, receives a line every ProgressEvery (default 10 s).
	Progress      io.Writer
	ProgressEvery time.Duration
	// Logger receives the engines' and the proxy's logs; nil discards.
	Logger *slog.Logger
}

func (c *Config) defaults() error {
	if c.Duration <= 0 {
		c.Duration = time.Minute
	}
	if c.Concurrency <= 0 {
		c.Concurrency = 4
	}
	if c.Policy == "" {
		c.Policy = connector.PolicyRecompute
	}
	if c.Policy != connector.PolicyFail && c.Policy != connector.PolicyRecompute {
		return fmt.Errorf("%w: policy %q must be fail or recompute", ErrConfig, c.Policy)
	}
	if c.Backend == "" {
		c.Backend = BackendTCP
	}
	if c.Backend != BackendTCP && c.Backend != BackendSHM {
		return fmt.Errorf("%w: backend %q must be TCP or SHM", ErrConfig, c.Backend)
	}
	if c.FaultInterval <= 0 {
		c.FaultInterval = 2 * time.Second
	}
	if c.Faults == nil {
		c.Faults = AllFaults()
	}
	for _, f := range c.Faults {
		known := false
		for _, k := range AllFaults() {
			known = known || f == k
		}
		if !known {
			return fmt.Errorf("%w: unknown fault %q (known: %v)", ErrConfig, f, AllFaults())
		}
	}
	if c.Model == "" {
		c.Model = model.Tiny
	}
	if c.ProgressEvery <= 0 {
		c.ProgressEvery = 10 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return nil
}

// quiesceDeadline bounds the wait for the stack to settle after the run: the decoder TTL and
// the lease of the stack (8 s and 5 s) plus margin.
const quiesceDeadline = 60 * time.Second

// Run starts the stack, takes the starting snapshot, runs the workload and the faults for
// cfg.Duration, lets the stack quiesce, takes the final snapshot and returns the report. The
// report is returned with a nil error even when it finds wrong outputs or leaks (see
// Report.Pass); an error means the run itself could not be made.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	m, err := stack.OpenModel(ctx, cfg.Model, nil)
	if err != nil {
		return nil, err
	}
	defer m.Close()
	s, err := startRig(ctx, m, cfg.Policy, cfg.Backend, cfg.Logger)
	if err != nil {
		return nil, err
	}
	defer s.close()

	rep := newReport(cfg)
	// Warm up before the start snapshot, so that lazily built state (handshakes, prepared
	// descriptor lists, connection pools, and the forward pass's workspaces, which grow to the
	// longest context seen) exists in both snapshots: concurrency conversations longer than
	// any of the workload's.
	warm := newWorkload(s, rep, cfg.Seed^0x5eed, cfg.Concurrency)
	warm.warmUp(ctx)
	if rep.Served < int64(2*cfg.Concurrency) {
		return nil, fmt.Errorf("soak: the warm-up conversations failed: %v", rep.ErrorsByClass)
	}
	rep.resetCounts()
	if rep.Start, err = s.quiesce(ctx, quiesceDeadline); err != nil {
		return nil, fmt.Errorf("soak: before the run: %w", err)
	}

	runCtx, cancel := context.WithTimeout(ctx, cfg.Duration)
	defer cancel()
	start := time.Now()
	var wg sync.WaitGroup
	wl := newWorkload(s, rep, cfg.Seed, cfg.Concurrency)
	wg.Add(1)
	go func() {
		defer wg.Done()
		wl.run(runCtx)
	}()
	inj := newInjector(s, rep, cfg)
	wg.Add(1)
	go func() {
		defer wg.Done()
		inj.run(runCtx)
	}()
	wg.Add(1)
	go func() {
		defer wg.Done()
		watch(runCtx, s, rep)
	}()
	wg.Add(1)
	go func() {
		defer wg.Done()
		checkHealth(runCtx, s, rep)
	}()
	if cfg.Progress != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			progress(runCtx, cfg.Progress, cfg.ProgressEvery, s, rep, start)
		}()
	}
	wg.Wait()
	rep.DurationSeconds = time.Since(start).Seconds()
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	s.resetFaults()
	end, qerr := s.quiesce(ctx, quiesceDeadline)
	rep.End = end
	rep.Counters = map[string]map[string]float64{s.P.Name: s.totals(s.P), s.D.Name: s.totals(s.D)}
	rep.finish(qerr)
	return rep, nil
}

// progress writes a status line every interval until ctx ends.
func progress(ctx context.Context, w io.Writer, every time.Duration, s *rig, rep *Report, start time.Time) {
	repeat(ctx, every, func() {
		c := rep.counts()
		fmt.Fprintf(w, "soak %5.0fs: %d requests, %d served, %d errors, %d wrong outputs, %d faults, %d goroutines, free blocks P %d D %d\n",
			time.Since(start).Seconds(), c.Requests, c.Served, c.Errors, c.WrongOutputs, c.faults, runtime.NumGoroutine(),
			stats(s.P).FreeBlocks, stats(s.D).FreeBlocks)
	})
}

// healthEvery is how often the soak asks the proxy's /health, as a load balancer would. The
// multi-turn proxy drops stale conversations when asked (and when its /metrics is scraped);
// nothing else does, short of its 10,000-conversation cap.
const healthEvery = 5 * time.Second

// checkHealth polls the proxy's /health until ctx ends and records the conversations cached.
func checkHealth(ctx context.Context, s *rig, rep *Report) {
	repeat(ctx, healthEvery, func() {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.URL+"/health", nil)
		if err != nil {
			return
		}
		resp, err := s.client.Do(req)
		if err != nil {
			if ctx.Err() == nil { // not the end of the run cutting the request short
				rep.countError("health check: " + transportClass(err))
			}
			return
		}
		var h struct {
			Cached int `json:"cached_conversations"`
		}
		err = json.NewDecoder(resp.Body).Decode(&h)
		resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusOK {
			rep.countError(fmt.Sprintf("health check: %d", resp.StatusCode))
			return
		}
		rep.sampleCache(h.Cached)
	})
}

// watchEvery is the period of the pool samples.
const watchEvery = 100 * time.Millisecond

// watch samples the engines until ctx ends: the fewest free blocks, the most requests waiting
// and the most finished requests holding blocks.
func watch(ctx context.Context, s *rig, rep *Report) {
	repeat(ctx, watchEvery, func() {
		for _, e := range []*stack.Engine{s.P, s.D} {
			st := stats(e)
			rep.sample(e.Name, st.FreeBlocks, st.Waiting, st.Held)
		}
	})
}

// repeat calls f every interval until ctx ends.
func repeat(ctx context.Context, every time.Duration, f func()) {
	tk := time.NewTicker(every)
	defer tk.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tk.C:
			f()
		}
	}
}
