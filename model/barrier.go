package model

import (
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// barrier holds the tensor-parallel ranks of a step together between the phases of a layer
// (tp.go). It is reused across phases and steps without allocating: a phase's last arrival
// opens it by advancing the generation. A waiter polls for barrierSpin (running items of the
// ranks still in the phase when it is given a help function — tp.go's load sharing — and
// otherwise yielding its processor between checks, so a rank that shares a core with the others
// lets them run), then parks on a condition variable: back-to-back phases find the other ranks
// polling, and a rank that waits long (a loaded machine, an uneven phase) costs no CPU.
//
// A rank that cannot go on (its work panicked) breaks the barrier: every wait returns false
// from then until reset, so no rank waits for one that will never arrive.
type barrier struct {
	n       int32
	arrived atomic.Int32
	gen     atomic.Uint32
	broken  atomic.Bool
	mu      sync.Mutex
	cond    sync.Cond
}

// barrierSpin (and at most barrierMaxSpins checks) is how long a waiter polls before parking.
// A layer's phase at decode is tens of microseconds: waking a parked thread costs about as much.
const (
	barrierSpin     = 50 * time.Microsecond
	barrierMaxSpins = 1000
)

// newBarrier returns a barrier for n ranks.
func newBarrier(n int) *barrier {
	b := &barrier{n: int32(n)}
	b.cond.L = &b.mu
	return b
}

// reset readies the barrier for a new step. No rank may be waiting.
func (b *barrier) reset() {
	b.arrived.Store(0)
	b.broken.Store(false)
}

// wait returns when all n ranks have called it for this phase (true), or when the barrier is
// broken (false). help, if not nil, is the waiter's work while it polls: it runs an item of a
// rank still in the phase and reports whether there was one (the poll starts over after it).
func (b *barrier) wait(help func() bool) bool {
	g := b.gen.Load()
	if b.arrived.Add(1) == b.n {
		b.arrived.Store(0)
		b.mu.Lock()
		b.gen.Add(1)
		b.mu.Unlock()
		b.cond.Broadcast()
		return !b.broken.Load()
	}
	open := func() bool { return b.gen.Load() != g || b.broken.Load() }
	t0 := time.Now()
	for i := 0; !open() && i < barrierMaxSpins && (i%16 != 15 || time.Since(t0) < barrierSpin); i++ {
		if help != nil && help() {
			i, t0 = 0, time.Now()
			continue
		}
		runtime.Gosched()
	}
	if !open() {
		b.mu.Lock()
		for !open() {
			b.cond.Wait()
		}
		b.mu.Unlock()
	}
	return !b.broken.Load()
}

// receive returns the next value from c (ok false once c is closed and drained), polling for
// barrierSpin as a barrier's waiter does before it parks: the ranks take a step's work, and its
// caller their results, without waking a parked thread when they come back to back.
func receive[T any](c <-chan T) (v T, ok bool) {
	t0 := time.Now()
	for i := 0; i < barrierMaxSpins && (i%16 != 15 || time.Since(t0) < barrierSpin); i++ {
		select {
		case v, ok = <-c:
			return v, ok
		default:
		}
		runtime.Gosched()
	}
	v, ok = <-c
	return v, ok
}

// breakAll breaks the barrier: every current and later wait returns false until reset.
func (b *barrier) breakAll() {
	b.mu.Lock()
	b.broken.Store(true)
	b.mu.Unlock()
	b.cond.Broadcast()
}
