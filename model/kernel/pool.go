package kernel

import (
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// Pool is a fixed set of worker goroutines that run [Pool.Parallel] loops.
//
// Ownership: whoever calls [NewPool] owns the pool and its goroutines and must call
// [Pool.Close], which stops the workers and waits for them to exit. The workers start lazily on
// the first Parallel call, so an unused pool costs nothing. A pool is safe for concurrent use:
// concurrent (and nested) Parallel calls share the workers, and the calling goroutine always
// takes part, so a call never waits for a busy worker to become free. After Close, Parallel
// still works but runs everything on the calling goroutine. A nil *Pool behaves like the
// package-level [Parallel] (short-lived goroutines owned by the call).
type Pool struct {
	workers int
	team    int                 // Workers' answer when more than workers (Share)
	shared  bool                // Parallel publishes its job in current (Share)
	current atomic.Pointer[job] // the Parallel call whose items Help takes (shared pools only)

	mu      sync.RWMutex // guards jobs/closed against Close; held (read) while posting jobs
	jobs    chan *job    // nil until started
	closed  bool
	running sync.WaitGroup // live worker goroutines
	parked  atomic.Int32   // workers blocked in a channel receive

	pairs sync.Pool // *[]uint32: activation pairs of bfloat16 products, reused across calls

	observe func(ParallelSpan) // Observe; nil: no timing is taken
}

// ParallelSpan is the timing of one [Pool.Parallel] call, as an observer ([Pool.Observe]) gets
// it: when the call began and returned on its caller, and, for each goroutine that ran items of
// it, when it claimed its first item and when it finished its last.
type ParallelSpan struct {
	Start, End time.Time
	Items      int
	Shares     []ShareSpan
}

// ShareSpan is one goroutine's share of a Parallel call (ParallelSpan).
type ShareSpan struct {
	First, Last time.Time
	Items       int
	Caller      bool // the goroutine that called Parallel
}

// Observe makes every later Parallel call of p report its timing to fn (nil: stop), on the
// calling goroutine after the call's items have finished. It is for measurements (how a step's
// wall time divides between work and hand-offs); without an observer a call takes no timing.
// Call it while no Parallel call runs.
func (p *Pool) Observe(fn func(ParallelSpan)) {
	p.observe = fn
}

// pairBuffer returns a buffer of n uint32s (from the pool's free list when p is not nil) and the
// function that gives it back.
func (p *Pool) pairBuffer(n int) ([]uint32, func()) {
	if p == nil {
		return make([]uint32, n), func() {}
	}
	b, _ := p.pairs.Get().(*[]uint32)
	if b == nil || cap(*b) < n {
		b = new([]uint32)
		*b = make([]uint32, n)
	}
	buf := (*b)[:n]
	return buf, func() { p.pairs.Put(b) }
}

// NewPool returns a pool of n workers (the calling goroutine counts as one of them, so n-1
// goroutines are started). n ≤ 0 means runtime.GOMAXPROCS(0).
func NewPool(n int) *Pool {
	if n <= 0 {
		n = runtime.GOMAXPROCS(0)
	}
	return &Pool{workers: n}
}

// Workers returns the number of goroutines (including the caller) a Parallel call may use:
// with [Pool.Share], those of the whole team that helps one another.
func (p *Pool) Workers() int {
	if p == nil {
		return runtime.GOMAXPROCS(0)
	}
	return max(p.workers, p.team)
}

// goroutines returns the number of goroutines of the pool's own (including the caller).
func (p *Pool) goroutines() int {
	if p == nil {
		return runtime.GOMAXPROCS(0)
	}
	return p.workers
}

// Share makes p one pool of a team of pools whose goroutines count team in all and help one
// another (the tensor-parallel ranks of a memory domain): a Parallel call publishes its job
// while its caller works on it, so that a goroutine with nothing else to do takes items of it
// with [Pool.Help], and Workers reports team, so that callers which split their work by it (the
// kernels' products) make items enough for the team. Which goroutine computes an item never
// changes how it is computed. Call it before the pool's first use.
func (p *Pool) Share(team int) {
	p.shared, p.team = true, team
}

// Help works on the unclaimed items of the Parallel call p's caller is running, if p is shared
// (Share) and there is one, and reports whether there was one. The call's caller still returns
// only when every item has finished, the ones Help ran included.
func (p *Pool) Help() bool {
	j := p.current.Load()
	if j == nil || j.next.Load() >= j.n {
		return false
	}
	j.work()
	return true
}

// Parallel runs fn(i) for every i in [0,n) and returns when all have returned. Calls may run
// concurrently on up to Workers() goroutines, in any order. If fn panics, the first panic value
// is re-raised on the calling goroutine after the other calls have finished.
func (p *Pool) Parallel(n int, fn func(i int)) {
	if n <= 0 {
		return
	}
	helpers := min(n, p.goroutines()) - 1
	j := &job{n: int64(n), fn: fn}
	var start time.Time
	if p != nil && p.observe != nil {
		start = time.Now()
		j.shares = make([]ShareSpan, p.Workers()+1)
	}
	j.pending.Add(n)
	j.left.Store(int64(n))
	// A shared pool's call (not a nested or concurrent one: one job is published at a time) is
	// offered to Help until its caller has claimed the last item.
	published := p != nil && p.shared && p.current.CompareAndSwap(nil, j)
	switch {
	case helpers <= 0:
		j.workAs(true)
	case p == nil:
		var exited sync.WaitGroup
		for range helpers {
			exited.Go(j.work)
		}
		runtime.Gosched() // let a helper start now (see post)
		j.work()
		exited.Wait()
	default:
		p.post(j, helpers)
		j.workAs(true)
	}
	if published {
		p.current.CompareAndSwap(j, nil)
	}
	j.wait()
	if j.shares != nil {
		j.report(p.observe, start)
	}
	if j.panicked.Load() {
		panic(j.panicVal)
	}
}

// report gives an observed call's timing to fn.
func (j *job) report(fn func(ParallelSpan), start time.Time) {
	sp := ParallelSpan{Start: start, End: time.Now(), Items: int(j.n)}
	for _, sh := range j.shares[:min(len(j.shares), int(j.nshares.Load()))] {
		if sh.Items > 0 {
			sp.Shares = append(sp.Shares, sh)
		}
	}
	fn(sp)
}

// Close stops the workers and waits for them to exit. It is idempotent and safe to call
// concurrently with Parallel (calls that start afterwards run on the caller).
func (p *Pool) Close() error {
	if p == nil {
		return nil
	}
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		if p.jobs != nil {
			close(p.jobs)
		}
	}
	p.mu.Unlock()
	p.running.Wait()
	return nil
}

// Parallel runs fn(i) for every i in [0,n) on up to GOMAXPROCS goroutines and returns when all
// are done. It keeps no state: the helper goroutines belong to the call and have exited when it
// returns. Use a [Pool] to reuse goroutines across calls.
func Parallel(n int, fn func(i int)) {
	(*Pool)(nil).Parallel(n, fn)
}

// post offers j to up to helpers idle workers without blocking, starting the workers on first
// use. A parked worker that receives the job becomes runnable on the caller's processor, where
// it would wait for the caller to block; if any worker was parked (or has just been started),
// post yields once so the worker starts at once and the scheduler moves the caller to an idle
// processor.
func (p *Pool) post(j *job, helpers int) {
	p.mu.RLock()
	if p.closed {
		p.mu.RUnlock()
		return
	}
	yield := false
	if p.jobs == nil {
		p.mu.RUnlock()
		p.start()
		p.mu.RLock()
		if p.closed {
			p.mu.RUnlock()
			return
		}
		yield = true
	}
	yield = yield || p.parked.Load() > 0
	for range helpers {
		select {
		case p.jobs <- j:
			continue
		default:
		}
		break
	}
	p.mu.RUnlock()
	if yield {
		runtime.Gosched()
	}
}

func (p *Pool) start() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.jobs != nil || p.closed {
		return
	}
	p.jobs = make(chan *job, p.workers)
	for range p.workers - 1 {
		p.running.Go(p.worker)
	}
}

// spinFor (and at most maxSpins checks, so that polling also ends inside a testing/synctest
// bubble, where the clock stands still) is how long an idle worker keeps polling for the next
// job, and a caller for its job's last items, before parking. Waking a parked OS thread costs tens of microseconds on a
// virtual machine, as much as a decode-sized matrix-vector product takes; back-to-back
// Parallel calls (one per layer) find the workers still polling. Polling yields the processor
// (runtime.Gosched) between checks, so other goroutines still run, and a yielding goroutine
// prompts the scheduler to wake an idle processor, which keeps the caller and the workers on
// different cores.
const (
	spinFor  = 100 * time.Microsecond
	maxSpins = 2000
)

// spinning reports whether a poll loop that started at t0 and has checked i times should go on.
func spinning(t0 time.Time, i int) bool {
	return i < maxSpins && (i%16 != 15 || time.Since(t0) < spinFor)
}

// worker runs jobs until the pool is closed: poll for spinFor after each job, then park.
func (p *Pool) worker() {
	for {
		var j *job
		var ok bool
		t0 := time.Now()
	poll:
		for i := 0; ; i++ {
			select {
			case j, ok = <-p.jobs:
				break poll
			default:
			}
			if !spinning(t0, i) {
				p.parked.Add(1)
				j, ok = <-p.jobs
				p.parked.Add(-1)
				break
			}
			runtime.Gosched()
		}
		if !ok {
			return
		}
		j.work()
	}
}

// job is one Parallel call: items are claimed with an atomic counter by every participant.
type job struct {
	n        int64
	fn       func(i int)
	next     atomic.Int64
	pending  sync.WaitGroup // items not yet finished
	left     atomic.Int64   // the same count, for polling
	panicked atomic.Bool
	panicVal any
	// shares, for an observed call (Pool.Observe), holds each participant's timing; nshares
	// counts the slots taken.
	shares  []ShareSpan
	nshares atomic.Int32
}

func (j *job) work() { j.workAs(false) }

// workAs runs items until none is left; caller says whether the goroutine is the call's caller.
func (j *job) workAs(caller bool) {
	var sh *ShareSpan
	for j.next.Load() < j.n {
		i := j.next.Add(1) - 1
		if i >= j.n {
			return
		}
		if j.shares != nil && sh == nil {
			if k := int(j.nshares.Add(1)) - 1; k < len(j.shares) {
				sh = &j.shares[k]
				sh.First, sh.Caller = time.Now(), caller
			}
		}
		j.do(int(i), sh)
	}
}

// wait returns when every item has finished: it polls for up to spinFor, then parks.
func (j *job) wait() {
	t0 := time.Now()
	for i := 0; j.left.Load() > 0 && spinning(t0, i); i++ {
		runtime.Gosched()
	}
	j.pending.Wait()
}

// do runs item i; sh, if not nil, is the running goroutine's share of an observed call, whose
// end it records before the item counts as finished.
func (j *job) do(i int, sh *ShareSpan) {
	defer j.pending.Done()
	defer j.left.Add(-1)
	defer func() {
		if r := recover(); r != nil {
			if j.panicked.CompareAndSwap(false, true) {
				j.panicVal = r
			}
		}
	}()
	j.fn(i)
	if sh != nil {
		sh.Last = time.Now()
		sh.Items++
	}
}
