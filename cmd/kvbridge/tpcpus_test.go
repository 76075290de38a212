package main

import (
	"reflect"
	"strings"
	"testing"
)

// TestParseRankCPUs: vLLM's VLLM_CPU_OMP_THREADS_BIND lists, one per rank, and what is refused.
func TestParseRankCPUs(t *testing.T) {
	for in, want := range map[string][][]int{
		"":            nil,
		"auto":        nil,
		"nobind":      nil,
		"0-3|4-7":     {{0, 1, 2, 3}, {4, 5, 6, 7}},
		"0,2 | 1,3-4": {{0, 2}, {1, 3, 4}},
		"5":           {{5}},
	} {
		got, err := parseRankCPUs(in)
		if err != nil || !reflect.DeepEqual(got, want) {
			t.Errorf("parseRankCPUs(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"x", "0-", "3-1", "-1", "0|", "1024", "0,,1"} {
		if _, err := parseRankCPUs(in); err == nil || !strings.Contains(err.Error(), "bad CPU list") {
			t.Errorf("parseRankCPUs(%q): err = %v, want a bad CPU list", in, err)
		}
	}
}
