package main

import (
	"fmt"
	"strconv"
	"strings"
)

// maxCPU bounds the CPU ids --tp-cpus accepts (the kernel's CPU set holds 1024).
const maxCPU = 1024

// parseRankCPUs reads --tp-cpus (or VLLM_CPU_OMP_THREADS_BIND) as vLLM's CPU backend writes it:
// one CPU list per tensor-parallel rank, separated by '|', each a comma-separated list of CPU
// ids and inclusive ranges ("0-3|4-7", "0,2|1,3"). "", "auto" and "nobind" pin nothing (vLLM's
// "auto" binds each rank to a NUMA node's CPUs; without NUMA nodes that is no binding).
func parseRankCPUs(s string) ([][]int, error) {
	s = strings.TrimSpace(s)
	switch s {
	case "", "auto", "nobind":
		return nil, nil
	}
	var sets [][]int
	for _, rank := range strings.Split(s, "|") {
		var set []int
		for _, item := range strings.Split(rank, ",") {
			lo, hi, isRange := strings.Cut(strings.TrimSpace(item), "-")
			a, err := strconv.Atoi(lo)
			b := a
			if err == nil && isRange {
				b, err = strconv.Atoi(hi)
			}
			if err != nil || a < 0 || b < a || b >= maxCPU {
				return nil, fmt.Errorf("bad CPU list %q in %q (want ids and ranges such as 0-3,8 below %d, one list per rank separated by |)", item, s, maxCPU)
			}
			for c := a; c <= b; c++ {
				set = append(set, c)
			}
		}
		sets = append(sets, set)
	}
	return sets, nil
}
