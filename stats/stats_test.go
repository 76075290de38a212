package stats

import (
	"math"
	"slices"
	"testing"
	"time"
)

// The expected values are derived by hand from the definitions in the comments.
func TestSummaries(t *testing.T) {
	xs := []float64{3, 1, 4, 1, 5, 9, 2, 6} // sorted: 1 1 2 3 4 5 6 9
	orig := slices.Clone(xs)
	for _, tc := range []struct {
		name      string
		got, want float64
	}{
		{"mean", Mean(xs), 31.0 / 8},
		{"mean of nothing", Mean(nil), 0},
		{"median of an even count: (3+4)/2", Median(xs), 3.5},
		{"median of an odd count", Median([]float64{7, 1, 3}), 3},
		{"median of nothing", Median(nil), 0},
		// Nearest rank: the ⌈q·8⌉-th smallest.
		{"nearest-rank p50: 4th", NearestRank(xs, 0.5), 3},
		{"nearest-rank p90: ⌈7.2⌉ = 8th", NearestRank(xs, 0.9), 9},
		{"nearest-rank p0: the smallest", NearestRank(xs, 0), 1},
		{"nearest-rank p99 of 100: the 99th, not the 100th", NearestRank(seq(100), 0.99), 99},
		{"nearest-rank of nothing", NearestRank(nil, 0.5), 0},
		{"nearest-rank p50 of 10: the 5th", NearestRank(seq(10), 0.5), 5},
		{"nearest-rank p99 of 10: ⌈9.9⌉ = 10th", NearestRank(seq(10), 0.99), 10},
		{"median of 3 1 2 10: (2+3)/2", Median([]float64{3, 1, 2, 10}), 2.5},
		// Linear: position q·(n−1) between the closest ranks.
		{"quantile 0.25: position 1.75 between 1 and 2", Quantile(xs, 0.25), 1.75},
		{"quantile 0.5: position 3.5 between 3 and 4", Quantile(xs, 0.5), 3.5},
		{"quantile 0.9: position 6.3 between 6 and 9", Quantile(xs, 0.9), 6.9},
		{"quantile 1: the largest", Quantile(xs, 1), 9},
		{"quantile 0: the smallest", Quantile(xs, 0), 1},
		{"quantile of one value", Quantile([]float64{4}, 0.3), 4},
		{"milliseconds", Ms(1500 * time.Microsecond), 1.5},
	} {
		if math.Abs(tc.got-tc.want) > 1e-12 {
			t.Errorf("%s: got %v, want %v", tc.name, tc.got, tc.want)
		}
	}
	if !math.IsNaN(Quantile(nil, 0.5)) {
		t.Error("the quantile of nothing is not NaN")
	}
	if !slices.Equal(xs, orig) {
		t.Errorf("the input was modified: %v", xs)
	}
}

// TestQuantileMatchesNumpy: numpy.quantile(a, 0.9), hand-computed with its linear method (the
// "KV Transfer metrics" line's P90s must match vLLM's to the last printed digit).
func TestQuantileMatchesNumpy(t *testing.T) {
	for _, tt := range []struct {
		a    []float64
		want float64
	}{
		{[]float64{5}, 5},
		{[]float64{1, 2}, 1.9},          // virtual 0.9
		{[]float64{4, 1, 3, 2, 5}, 4.6}, // virtual 3.6 → 4 + 0.6
		{[]float64{10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110}, 100}, // virtual 9.0
	} {
		if got := Quantile(tt.a, 0.9); math.Abs(got-tt.want) > 1e-12 {
			t.Errorf("Quantile(%v, 0.9) = %v, want %v", tt.a, got, tt.want)
		}
	}
}

// seq returns 1..n.
func seq(n int) []float64 {
	out := make([]float64, n)
	for i := range out {
		out[i] = float64(i + 1)
	}
	return out
}
