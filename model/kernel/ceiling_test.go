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
	if g := MemcpyGBps(1 << 20); !(g > 0) {
		t.Fatalf("MemcpyGBps = %v", g)
	}
	if g := ReadGBps(1 << 20); !(g > 0) {
		t.Fatalf("ReadGBps = %v", g)
	}
}
