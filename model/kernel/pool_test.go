package kernel

import (
	"runtime"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"
)

func TestParallelRunsEachIndexOnce(t *testing.T) {
	for _, p := range []*Pool{nil, NewPool(1), NewPool(2), NewPool(5)} {
		for _, n := range []int{0, 1, 2, 3, 10, 1000} {
			hits := make([]atomic.Int32, n)
			p.Parallel(n, func(i int) { hits[i].Add(1) })
			for i := range hits {
				if hits[i].Load() != 1 {
					t.Fatalf("workers %d n %d: index %d ran %d times", p.Workers(), n, i, hits[i].Load())
				}
			}
		}
		p.Close()
	}
	var c atomic.Int32
	Parallel(17, func(int) { c.Add(1) })
	if c.Load() != 17 {
		t.Fatalf("Parallel ran %d", c.Load())
	}
}

func TestParallelNestedAndAfterClose(t *testing.T) {
	p := NewPool(2)
	var c atomic.Int32
	p.Parallel(4, func(int) { p.Parallel(4, func(int) { c.Add(1) }) })
	if c.Load() != 16 {
		t.Fatalf("nested: %d", c.Load())
	}
	p.Close()
	p.Close()
	p.Parallel(3, func(int) { c.Add(1) })
	if c.Load() != 19 {
		t.Fatalf("after Close: %d", c.Load())
	}
}

func TestParallelPanicReachesCaller(t *testing.T) {
	p := NewPool(2)
	defer p.Close()
	var done atomic.Int32
	func() {
		defer func() {
			if r := recover(); r != "boom" {
				t.Fatalf("recovered %v", r)
			}
			if done.Load() != 9 {
				t.Fatalf("%d other items finished, want 9", done.Load())
			}
		}()
		p.Parallel(10, func(i int) {
			if i == 3 {
				panic("boom")
			}
			done.Add(1)
		})
	}()
}

// TestPoolLeavesNoGoroutines runs a pool inside a synctest bubble: the bubble fails the test if
// any goroutine it started is still blocked when the function returns.
func TestPoolLeavesNoGoroutines(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := NewPool(4)
		var c atomic.Int32
		for range 10 {
			p.Parallel(8, func(int) { c.Add(1) })
		}
		l := NewLinearOn(p, make([]float32, 300*20), 300, 20)
		l.Apply(make([]float32, 9*300), make([]float32, 9*20), 9)
		Parallel(5, func(int) { c.Add(1) })
		// The workers must stop polling and park, or the bubble's clock could never advance.
		time.Sleep(time.Second)
		synctest.Wait()
		if err := p.Close(); err != nil {
			t.Fatal(err)
		}
		if c.Load() != 85 {
			t.Fatalf("ran %d", c.Load())
		}
	})
}

// TestPoolHelp: a shared one-worker pool's Parallel call is taken part in by a goroutine that
// calls Help — two items run at once, where the pool alone would run them one after the other —
// every item runs once, and Help finds nothing once the call has returned or on a pool not shared.
func TestPoolHelp(t *testing.T) {
	p := NewPool(1)
	defer p.Close()
	if p.Help() {
		t.Fatal("Help on an idle pool found work")
	}
	p.Share(2)
	if p.Workers() != 2 {
		t.Fatalf("Workers of a pool shared by 2 = %d", p.Workers())
	}
	const n = 2
	var hits [n]atomic.Int32
	var first atomic.Bool
	other := make(chan struct{})
	overlapped := false
	helped := make(chan bool)
	go func() {
		deadline := time.Now().Add(10 * time.Second)
		for !p.Help() {
			if time.Now().After(deadline) {
				helped <- false
				return
			}
			runtime.Gosched()
		}
		helped <- true
	}()
	p.Parallel(n, func(i int) {
		hits[i].Add(1)
		if first.CompareAndSwap(false, true) {
			// The first item waits for the second, which only a second goroutine can run.
			select {
			case <-other:
				overlapped = true
			case <-time.After(10 * time.Second):
			}
			return
		}
		close(other)
	})
	if !<-helped {
		t.Fatal("Help found no work while a Parallel call ran")
	}
	if !overlapped {
		t.Fatal("the call's items did not run at once on the caller and the helper")
	}
	for i := range hits {
		if hits[i].Load() != 1 {
			t.Fatalf("index %d ran %d times", i, hits[i].Load())
		}
	}
	if p.Help() {
		t.Fatal("Help found work after the call returned")
	}
	unshared := NewPool(1)
	defer unshared.Close()
	unshared.Parallel(3, func(int) {
		if unshared.Help() {
			t.Error("Help found work on a pool not shared")
		}
	})
}

func TestPoolObserveReportsEveryItem(t *testing.T) {
	p := NewPool(3)
	defer p.Close()
	var spans []ParallelSpan
	p.Observe(func(sp ParallelSpan) { spans = append(spans, sp) })
	for _, n := range []int{1, 2, 7, 100} {
		p.Parallel(n, func(int) {})
	}
	p.Observe(nil)
	p.Parallel(5, func(int) {})
	if len(spans) != 4 {
		t.Fatalf("%d spans, want 4 (one per observed call)", len(spans))
	}
	for k, n := range []int{1, 2, 7, 100} {
		sp := spans[k]
		items, callers := 0, 0
		for _, sh := range sp.Shares {
			items += sh.Items
			if sh.Caller {
				callers++
			}
			if sh.First.Before(sp.Start) || sh.Last.Before(sh.First) || sp.End.Before(sh.Last) {
				t.Errorf("call of %d items: share %+v outside the call [%v, %v]", n, sh, sp.Start, sp.End)
			}
		}
		if sp.Items != n || items != n || callers > 1 {
			t.Errorf("call of %d items: span says %d, shares ran %d, %d of them the caller's", n, sp.Items, items, callers)
		}
	}
}
