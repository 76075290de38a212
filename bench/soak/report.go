package soak

import (
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"strings"
	"sync"
)

// Tolerances of the flatness verdict: after the stack quiesced, the run may end with at most
// this many more goroutines, this much more live heap and this much more resident memory than
// it started with. Resident memory covers what the heap does not: the KV arenas, and the peers'
// arenas a transfer agent maps over SHM.
const (
	goroutineTolerance = 10
	heapTolerance      = 32 << 20
	rssTolerance       = 128 << 20
)

// Snapshot is the process and the pools at one moment (after a GC).
type Snapshot struct {
	HeapAllocBytes uint64         `json:"heap_alloc_bytes"`
	RSSBytes       uint64         `json:"rss_bytes"`
	Goroutines     int            `json:"goroutines"`
	FreeBlocks     map[string]int `json:"free_blocks"`
	NumBlocks      map[string]int `json:"num_blocks"`
}

// WrongOutput is an answer that differs from the single engine's.
type WrongOutput struct {
	ConversationID string `json:"conversation_id"`
	Turn           int    `json:"turn"`
	Cache          string `json:"cache"`
	Streaming      bool   `json:"streaming"`
	Got            string `json:"got"`
	Want           string `json:"want"`
}

// maxExamples bounds the wrong outputs kept in the report.
const maxExamples = 10

// Report is the outcome of a soak run.
type Report struct {
	DurationSeconds float64  `json:"duration_seconds"`
	Seed            int64    `json:"seed"`
	Policy          string   `json:"policy"`
	Backend         string   `json:"backend"`
	Concurrency     int      `json:"concurrency"`
	FaultKinds      []string `json:"fault_kinds"`

	// Requests counts the requests sent through the proxy; Served those answered in full and
	// right; Errors those that failed, by class; WrongOutputs those answered with a text that
	// differs from the single engine's.
	Requests      int64            `json:"requests"`
	Served        int64            `json:"served"`
	Errors        int64            `json:"errors"`
	ErrorsByClass map[string]int64 `json:"errors_by_class"`
	WrongOutputs  int64            `json:"wrong_outputs"`
	WrongExamples []WrongOutput    `json:"wrong_output_examples,omitempty"`
	// MinFreeBlocks, MaxWaiting and MaxHeld are sampled during the run per engine: the fewest
	// free KV blocks, the most requests waiting, the most finished requests holding blocks.
	MinFreeBlocks map[string]int `json:"min_free_blocks"`
	MaxWaiting    map[string]int `json:"max_waiting"`
	MaxHeld       map[string]int `json:"max_held"`
	// MaxCachedConversations is the most conversations the proxy's /health reported cached.
	MaxCachedConversations int `json:"max_cached_conversations"`
	// Counters are the engines' transfer counters at the end, summed over restarts, per
	// engine and metric name (failed transfers and notifications, expired leases, …).
	Counters map[string]map[string]float64 `json:"counters"`
	// CacheHits and CacheMisses are the proxy's X-KVBridge-Cache answers.
	CacheHits   int64 `json:"cache_hits"`
	CacheMisses int64 `json:"cache_misses"`
	// PulledTurns counts the turns whose prefill pulled tokens from D, PulledTokens the tokens.
	PulledTurns  int64 `json:"pulled_turns"`
	PulledTokens int64 `json:"pulled_tokens"`
	// Faults counts the faults injected by kind, and FaultsByTarget by kind and path.
	Faults         map[string]int64 `json:"faults"`
	FaultsByTarget map[string]int64 `json:"faults_by_target"`

	Start Snapshot `json:"start"`
	End   Snapshot `json:"end"`
	// LeakedBlocks is the blocks of P and D not free at the end, once the stack quiesced.
	LeakedBlocks    int    `json:"leaked_blocks"`
	GoroutineGrowth int    `json:"goroutine_growth"`
	HeapGrowthBytes int64  `json:"heap_growth_bytes"`
	RSSGrowthBytes  int64  `json:"rss_growth_bytes"`
	Flat            bool   `json:"flat"`
	Quiesce         string `json:"quiesce_error,omitempty"`
	// Pass is true when there were no wrong outputs, no leaked blocks and the process is flat.
	Pass     bool     `json:"pass"`
	Failures []string `json:"failures,omitempty"`

	mu sync.Mutex
}

func newReport(cfg Config) *Report {
	r := &Report{Seed: cfg.Seed, Policy: string(cfg.Policy), Backend: cfg.Backend, Concurrency: cfg.Concurrency, FaultKinds: cfg.Faults}
	r.resetCounts()
	return r
}

// resetCounts forgets the counts (of the warm-up).
func (r *Report) resetCounts() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.Requests, r.Served, r.Errors, r.WrongOutputs, r.CacheHits, r.CacheMisses, r.PulledTurns, r.PulledTokens = 0, 0, 0, 0, 0, 0, 0, 0
	r.ErrorsByClass, r.Faults, r.FaultsByTarget, r.WrongExamples = map[string]int64{}, map[string]int64{}, map[string]int64{}, nil
	r.MinFreeBlocks, r.MaxWaiting, r.MaxHeld = map[string]int{}, map[string]int{}, map[string]int{}
}

func (r *Report) sampleCache(n int) {
	r.mu.Lock()
	r.MaxCachedConversations = max(r.MaxCachedConversations, n)
	r.mu.Unlock()
}

func (r *Report) sample(engine string, free, waiting, held int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if f, ok := r.MinFreeBlocks[engine]; !ok || free < f {
		r.MinFreeBlocks[engine] = free
	}
	r.MaxWaiting[engine] = max(r.MaxWaiting[engine], waiting)
	r.MaxHeld[engine] = max(r.MaxHeld[engine], held)
}

func (r *Report) countRequest(cache string, pulled int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.Requests++
	if pulled > 0 {
		r.PulledTurns++
		r.PulledTokens += int64(pulled)
	}
	switch cache {
	case "hit":
		r.CacheHits++
	case "miss":
		r.CacheMisses++
	}
}

func (r *Report) countServed() {
	r.mu.Lock()
	r.Served++
	r.mu.Unlock()
}

func (r *Report) countError(class string) {
	r.mu.Lock()
	r.Errors++
	r.ErrorsByClass[class]++
	r.mu.Unlock()
}

func (r *Report) countWrong(w WrongOutput) {
	r.mu.Lock()
	r.WrongOutputs++
	if len(r.WrongExamples) < maxExamples {
		r.WrongExamples = append(r.WrongExamples, w)
	}
	r.mu.Unlock()
}

func (r *Report) countFault(kind, label string) {
	r.mu.Lock()
	r.Faults[kind]++
	r.FaultsByTarget[label]++
	r.mu.Unlock()
}

// counts is a consistent copy of the running counts.
type counts struct {
	Requests, Served, Errors, WrongOutputs, faults int64
}

func (r *Report) counts() counts {
	r.mu.Lock()
	defer r.mu.Unlock()
	c := counts{Requests: r.Requests, Served: r.Served, Errors: r.Errors, WrongOutputs: r.WrongOutputs}
	for _, n := range r.Faults {
		c.faults += n
	}
	return c
}

// finish computes the verdict from the snapshots.
func (r *Report) finish(quiesceErr error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if quiesceErr != nil {
		r.Quiesce = quiesceErr.Error()
	}
	r.LeakedBlocks = 0
	for name, n := range r.End.NumBlocks {
		r.LeakedBlocks += n - r.End.FreeBlocks[name]
	}
	r.GoroutineGrowth = r.End.Goroutines - r.Start.Goroutines
	r.HeapGrowthBytes = int64(r.End.HeapAllocBytes) - int64(r.Start.HeapAllocBytes)
	r.RSSGrowthBytes = int64(r.End.RSSBytes) - int64(r.Start.RSSBytes)
	r.Flat = r.GoroutineGrowth <= goroutineTolerance && r.HeapGrowthBytes <= heapTolerance && r.RSSGrowthBytes <= rssTolerance
	r.Failures = nil
	if r.WrongOutputs > 0 {
		r.Failures = append(r.Failures, fmt.Sprintf("%d wrong outputs", r.WrongOutputs))
	}
	if r.LeakedBlocks > 0 {
		r.Failures = append(r.Failures, fmt.Sprintf("%d blocks not free after the stack quiesced", r.LeakedBlocks))
	}
	if !r.Flat {
		r.Failures = append(r.Failures, fmt.Sprintf("not flat: %+d goroutines (tolerance %d), %s heap (tolerance %s), %s resident (tolerance %s)",
			r.GoroutineGrowth, goroutineTolerance, mibDelta(r.HeapGrowthBytes), mib(heapTolerance), mibDelta(r.RSSGrowthBytes), mib(rssTolerance)))
	}
	if r.Served == 0 {
		r.Failures = append(r.Failures, "no request was served")
	}
	r.Pass = len(r.Failures) == 0
}

// WriteText writes the human-readable report.
func (r *Report) WriteText(w io.Writer) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	var b strings.Builder
	fmt.Fprintf(&b, "kvbridge soak: %.0f s, seed %d, policy %s, backend %s, %d conversations in flight, faults %s\n",
		r.DurationSeconds, r.Seed, r.Policy, r.Backend, r.Concurrency, strings.Join(r.FaultKinds, ","))
	fmt.Fprintf(&b, "requests        %d (served right %d, errors %d, wrong outputs %d)\n", r.Requests, r.Served, r.Errors, r.WrongOutputs)
	fmt.Fprintf(&b, "proxy cache     %d hits, %d misses; %d turns pulled %d tokens from D; at most %d conversations cached\n",
		r.CacheHits, r.CacheMisses, r.PulledTurns, r.PulledTokens, r.MaxCachedConversations)
	fmt.Fprintf(&b, "faults          %s\n", formatCounts(r.Faults))
	if len(r.ErrorsByClass) > 0 {
		b.WriteString("errors by class\n")
		for _, k := range slices.Sorted(maps.Keys(r.ErrorsByClass)) {
			fmt.Fprintf(&b, "  %6d  %s\n", r.ErrorsByClass[k], k)
		}
	}
	for _, e := range r.WrongExamples {
		fmt.Fprintf(&b, "wrong output    %s turn %d (cache %s, streaming %v): got %q, want %q\n", e.ConversationID, e.Turn, e.Cache, e.Streaming, e.Got, e.Want)
	}
	fmt.Fprintf(&b, "%-15s %12s %12s %12s\n", "", "start", "end", "change")
	fmt.Fprintf(&b, "%-15s %12s %12s %12s\n", "heap", mib(int64(r.Start.HeapAllocBytes)), mib(int64(r.End.HeapAllocBytes)), mibDelta(r.HeapGrowthBytes))
	fmt.Fprintf(&b, "%-15s %12s %12s %12s\n", "rss", mib(int64(r.Start.RSSBytes)), mib(int64(r.End.RSSBytes)), mibDelta(r.RSSGrowthBytes))
	fmt.Fprintf(&b, "%-15s %12d %12d %+12d\n", "goroutines", r.Start.Goroutines, r.End.Goroutines, r.GoroutineGrowth)
	for _, name := range slices.Sorted(maps.Keys(r.End.NumBlocks)) {
		fmt.Fprintf(&b, "%-15s %12s %12s %+12d\n", "free blocks "+name,
			fmt.Sprintf("%d/%d", r.Start.FreeBlocks[name], r.Start.NumBlocks[name]),
			fmt.Sprintf("%d/%d", r.End.FreeBlocks[name], r.End.NumBlocks[name]), r.End.FreeBlocks[name]-r.Start.FreeBlocks[name])
	}
	for _, name := range slices.Sorted(maps.Keys(r.Counters)) {
		c := r.Counters[name]
		var parts []string
		for _, k := range slices.Sorted(maps.Keys(c)) {
			parts = append(parts, fmt.Sprintf("%s %.0f", strings.TrimSuffix(strings.TrimPrefix(k, "vllm:nixl_num_"), "_total"), c[k]))
		}
		fmt.Fprintf(&b, "counters %s      %s\n", name, strings.Join(parts, ", "))
	}
	for _, name := range slices.Sorted(maps.Keys(r.MinFreeBlocks)) {
		fmt.Fprintf(&b, "during the run  %s: at least %d blocks free, at most %d requests waiting, %d finished requests holding blocks\n",
			name, r.MinFreeBlocks[name], r.MaxWaiting[name], r.MaxHeld[name])
	}
	fmt.Fprintf(&b, "leaked blocks   %d\n", r.LeakedBlocks)
	if r.Quiesce != "" {
		fmt.Fprintf(&b, "quiesce         %s\n", r.Quiesce)
	}
	if r.Pass {
		b.WriteString("verdict         PASS (0 wrong outputs, 0 leaked blocks, flat)\n")
	} else {
		fmt.Fprintf(&b, "verdict         FAIL: %s\n", strings.Join(r.Failures, "; "))
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// WriteJSON writes the report as JSON to path.
func (r *Report) WriteJSON(path string) error {
	r.mu.Lock()
	data, err := json.MarshalIndent(r, "", "  ")
	r.mu.Unlock()
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(data, '\n'), 0o644)
}

func formatCounts(m map[string]int64) string {
	if len(m) == 0 {
		return "none"
	}
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
	}
	return strings.Join(parts, ", ")
}

func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

func mibDelta(n int64) string { return fmt.Sprintf("%+.1f MiB", float64(n)/(1<<20)) }
