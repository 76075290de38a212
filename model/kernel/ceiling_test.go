package kernel

import (
	"testing"
	"time"
)

// The ceilings are measured, so only their sanity is asserted, never their size.
func TestCeilingsArePositive(t *testing.T) {
	if g := PeakGFLOPS(5 * time.Millisecond); !(g > 0) {
		t.Fatalf("PeakGFLOPS = %v", g)
	}
	if g := PeakInt8GOPS(5 * time.Millisecond); !(g > 0) && Int8Products() == "VPDPBUSD" || g != 0 && Int8Products() != "VPDPBUSD" {
		t.Fatalf("PeakInt8GOPS = %v with int8 products in %s", g, Int8Products())
	}
	if g := MemcpyGBps(1 << 20); !(g > 0) {
		t.Fatalf("MemcpyGBps = %v", g)
	}
	if g := ReadGBps(1 << 20); !(g > 0) {
		t.Fatalf("ReadGBps = %v", g)
	}
}

// A probe measures a positive rate, again and again over its one buffer, and each of its
// patterns reads every element of a share once, the tail past its last whole stretch included.
func TestReadProbe(t *testing.T) {
	p := NewReadProbe(1<<20, 2)
	for range 2 {
		if g := p.GBps(time.Millisecond); !(g > 0) {
			t.Fatalf("ReadProbe.GBps = %v", g)
		}
	}
	// One and a half chunks a stream and a tail, in a length readSum's grain (4 floats) divides.
	x := make([]float32, 3*probeChunk/4+136)
	for i := range x {
		x[i] = 1
	}
	for _, streams := range []int{1, 2, probeStreams} {
		if got := readStreams(x, streams); got != float32(len(x)) {
			t.Errorf("readStreams(%d streams) of %d ones = %v", streams, len(x), got)
		}
		if streams > 1 {
			if got := readInTurns(x, streams); got != float32(len(x)) {
				t.Errorf("readInTurns(%d streams) of %d ones = %v", streams, len(x), got)
			}
		}
	}
}
