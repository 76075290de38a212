package model

import (
	"errors"
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvbridge/kvbridge/model/kernel"
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

// TestMemoryDomains: CPU lists parse as the kernel writes them, this machine's CPUs are in a
// domain of its NUMA nodes, and ranks help exactly the other ranks of their domain.
func TestMemoryDomains(t *testing.T) {
	for _, c := range []struct {
		cpu  int
		want bool
	}{{0, true}, {3, true}, {4, false}, {8, true}, {9, false}, {11, true}, {12, false}} {
		if got := cpuListHas("0-3,8,10-11", c.cpu); got != c.want {
			t.Errorf("cpuListHas(0-3,8,10-11, %d) = %v", c.cpu, got)
		}
	}
	if d := memoryDomain(nil); d != "" {
		t.Errorf("the domain of an unpinned rank is %q", d)
	}
	if _, err := os.Stat("/sys/devices/system/node/node0/cpulist"); err == nil {
		var set unix.CPUSet
		if err := unix.SchedGetaffinity(0, &set); err == nil {
			for c := range 1024 {
				if set.IsSet(c) {
					if d := memoryDomain([]int{c}); d == "" || strings.Contains(d, ",") {
						t.Errorf("CPU %d is in domain %q, want one node", c, d)
					}
					break
				}
			}
		}
	}
	tp := &tensorParallel{ranks: make([]tpRank, 4)}
	for r := range tp.ranks {
		tp.ranks[r].m = &Model{pool: kernel.NewPool(1)}
	}
	for _, c := range []struct {
		domains []string
		helps   []bool
	}{
		{[]string{"", "", "", ""}, []bool{true, true, true, true}},
		{[]string{"0", "1", "2", "3"}, []bool{false, false, false, false}},
		{[]string{"0", "1", "0", "2"}, []bool{true, false, true, false}},
	} {
		for r, h := range tp.helpers(c.domains) {
			if (h != nil) != c.helps[r] {
				t.Errorf("domains %q: rank %d helps: %v, want %v", c.domains, r, h != nil, c.helps[r])
			}
		}
	}
}
