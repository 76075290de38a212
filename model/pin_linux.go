package model

import (
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// pinThread restricts the calling OS thread (locked to its goroutine) to cpus; none leaves it
// as it is.
func pinThread(cpus []int) error {
	if len(cpus) == 0 {
		return nil
	}
	var set unix.CPUSet
	for _, c := range cpus {
		set.Set(c)
	}
	return unix.SchedSetaffinity(0, &set)
}

// memoryDomain names the NUMA nodes whose CPUs cpus has ("0", "0,1"): ranks with the same name
// reach memory alike, so they can share each other's work (tp.go). No CPUs (an unpinned rank,
// which runs anywhere) or a machine that lists no nodes: "".
func memoryDomain(cpus []int) string {
	if len(cpus) == 0 {
		return ""
	}
	dirs, _ := filepath.Glob("/sys/devices/system/node/node[0-9]*")
	var nodes []string
	for _, d := range dirs {
		b, err := os.ReadFile(filepath.Join(d, "cpulist"))
		if err != nil {
			continue
		}
		if slices.ContainsFunc(cpus, func(c int) bool { return cpuListHas(strings.TrimSpace(string(b)), c) }) {
			nodes = append(nodes, strings.TrimPrefix(filepath.Base(d), "node"))
		}
	}
	return strings.Join(nodes, ",")
}

// cpuListHas reports whether a CPU list as the kernel writes it ("0-3,8,10-11") has cpu.
func cpuListHas(list string, cpu int) bool {
	for part := range strings.SplitSeq(list, ",") {
		lo, hi, found := strings.Cut(part, "-")
		a, err := strconv.Atoi(lo)
		if err != nil {
			continue
		}
		b := a
		if found {
			if b, err = strconv.Atoi(hi); err != nil {
				continue
			}
		}
		if a <= cpu && cpu <= b {
			return true
		}
	}
	return false
}
