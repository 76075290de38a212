package connector

import (
	"slices"
	"testing"
)

// TestLayerRangesMerge: the ranges of one WRITE of a layer-by-layer push are merged where both
// sides are contiguous — consecutive layers of a block, and consecutive blocks landing in
// consecutive blocks of the decoder — and kept apart otherwise (a layer missing, blocks apart
// on either side, a decoder of another block length).
func TestLayerRangesMerge(t *testing.T) {
	const block, layer = 400, 100
	pairs := [][2]int32{{4, 11}, {3, 10}, {6, 20}}
	jobs := func(layers ...int) []streamJob {
		var out []streamJob
		for _, l := range layers {
			out = append(out, streamJob{layer: l, pairs: pairs})
		}
		return out
	}
	for _, tc := range []struct {
		name        string
		jobs        []streamJob
		remoteBlock int64
		want        []layerRange
	}{
		{"every layer", jobs(3, 1, 0, 2), block, []layerRange{{1200, 4000, 800}, {2400, 8000, 400}}},
		{"one layer", jobs(2), block, []layerRange{{1400, 4200, 100}, {1800, 4600, 100}, {2600, 8200, 100}}},
		{"a layer missing", jobs(0, 1, 3), block, []layerRange{{1200, 4000, 200}, {1500, 4300, 300}, {1900, 4700, 100}, {2400, 8000, 200}, {2700, 8300, 100}}},
		{"another block length", jobs(0, 1, 2, 3), 2 * block, []layerRange{{1200, 8000, 400}, {1600, 8800, 400}, {2400, 16000, 400}}},
	} {
		if got := layerRanges(tc.jobs, block, tc.remoteBlock, layer); !slices.Equal(got, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}
