package model

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestBarrierPhases: no rank leaves a phase before every rank has arrived in it, over many
// reuses of one barrier; more ranks than cores, so waiters both poll and park.
func TestBarrierPhases(t *testing.T) {
	const ranks, phases = 4, 2000
	b := newBarrier(ranks)
	var arrived [phases]atomic.Int32
	var wg sync.WaitGroup
	for range ranks {
		wg.Go(func() {
			for p := range phases {
				arrived[p].Add(1)
				if !b.wait(nil) {
					t.Error("wait returned false on an unbroken barrier")
					return
				}
				if n := arrived[p].Load(); n != ranks {
					t.Errorf("phase %d: left with %d of %d ranks arrived", p, n, ranks)
					return
				}
			}
		})
	}
	wg.Wait()
}

// TestBarrierBreak: breaking the barrier releases the ranks waiting in it, later waits return
// false at once, and reset makes it whole again.
func TestBarrierBreak(t *testing.T) {
	b := newBarrier(3)
	released := make(chan bool, 2)
	for range 2 {
		go func() { released <- b.wait(nil) }()
	}
	b.breakAll()
	for range 2 {
		if <-released {
			t.Fatal("a waiter of a broken barrier got true")
		}
	}
	if b.wait(nil) {
		t.Fatal("a wait on a broken barrier returned true")
	}
	b.reset()
	var wg sync.WaitGroup
	for range 3 {
		wg.Go(func() {
			if !b.wait(nil) {
				t.Error("wait after reset returned false")
			}
		})
	}
	wg.Wait()
}

// BenchmarkBarrier is one phase of two ranks that do nothing else: the barrier's own cost.
func BenchmarkBarrier(b *testing.B) {
	bar := newBarrier(2)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range b.N {
			bar.wait(nil)
		}
	}()
	for range b.N {
		bar.wait(nil)
	}
	<-done
}

// TestBarrierWaiterHelps: a rank waiting for another runs its help function meanwhile (the work
// of the ranks still in the phase), and leaves once the last rank arrives.
func TestBarrierWaiterHelps(t *testing.T) {
	b := newBarrier(2)
	helped := make(chan struct{})
	var calls atomic.Int32
	left := make(chan bool)
	go func() {
		left <- b.wait(func() bool {
			if calls.Add(1) == 3 {
				close(helped)
			}
			return true
		})
	}()
	select {
	case <-helped:
	case <-time.After(10 * time.Second):
		t.Fatal("the waiter did not help while it waited")
	}
	if !b.wait(nil) || !<-left {
		t.Fatal("wait returned false on an unbroken barrier")
	}
}
