package model

import (
	"errors"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestTensorParallelPinned: ranks pinned to CPU sets compute TP 1's bits, and a CPU set no
// thread can run on fails Open naming the rank and the CPUs.
func TestTensorParallelPinned(t *testing.T) {
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		t.Skipf("no CPU affinity here: %v", err)
	}
	var cpus [][]int
	for c := range 1024 {
		if set.IsSet(c) {
			cpus = append(cpus, []int{c})
		}
	}
	spec, _ := builtinSpecs(Tiny)
	m, err := newBuiltin(Tiny, spec, precision{tp: 2, rankCPUs: cpus})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	requireSameRuns(t, "pinned", tpScenario(t, openTiny(t), false), tpScenario(t, m, false))

	_, err = newBuiltin(Tiny, spec, precision{tp: 2, rankCPUs: [][]int{cpus[0], {1023}}})
	if !errors.Is(err, ErrTensorParallel) || !strings.Contains(err.Error(), "rank 1: pin to CPUs [1023]") {
		t.Fatalf("CPU 1023: err = %v", err)
	}
}
