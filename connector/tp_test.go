package connector

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/kvbridge/kvbridge/kvcache"
)

// TestTPMapReadsEveryHeadFromItsHolder: for models of 1, 2, 4 and 8 KV heads and every pair of
// TP sizes one a multiple of the other (up to 8, replicated heads included), each chunk of each
// local rank is read from a producer rank and chunk that hold exactly the same model heads, and
// the descriptors of both chunks have the same length and lie inside their blocks.
func TestTPMapReadsEveryHeadFromItsHolder(t *testing.T) {
	for _, total := range []int{1, 2, 4, 8} {
		for _, local := range []int{1, 2, 4, 8} {
			for _, remote := range []int{1, 2, 4, 8} {
				lh, rh := headsPerRank(total, local), headsPerRank(total, remote)
				m, err := newTPMap(local, lh, remote, rh, total)
				if err != nil {
					t.Fatalf("K %d, TP %d ← %d: %v", total, local, remote, err)
				}
				lg := kvcache.Geometry{NumLayers: 2, NumKVHeads: lh, HeadDim: 4, BlockSize: 4, Layout: kvcache.HND}
				rg := lg
				rg.NumKVHeads = rh
				ld, rd := chunkDescs(1, lg, 3, m.unit), chunkDescs(2, rg, 3, m.unit)
				for r := range local {
					for c := range lh / m.unit {
						rr, rc := m.source(r, c)
						if rr < 0 || rr >= remote || rc < 0 || rc >= rh/m.unit {
							t.Fatalf("K %d, TP %d ← %d: rank %d chunk %d reads rank %d chunk %d, out of range", total, local, remote, r, c, rr, rc)
						}
						for u := range m.unit {
							want := globalHead(r, c*m.unit+u, local, lh, total)
							if got := globalHead(rr, rc*m.unit+u, remote, rh, total); got != want {
								t.Errorf("K %d, TP %d ← %d: rank %d head %d (model head %d) reads model head %d", total, local, remote, r, c*m.unit+u, want, got)
							}
						}
						li, ri := chunkIndex(lg, m.unit, 2, 1, 1, c), chunkIndex(rg, m.unit, 2, 1, 1, rc)
						if ld[li].Length != rd[ri].Length || ld[li].Offset+ld[li].Length > 3*int64(lg.BlockBytes()) || rd[ri].Offset+rd[ri].Length > 3*int64(rg.BlockBytes()) {
							t.Errorf("K %d, TP %d ← %d: descriptors %+v and %+v", total, local, remote, ld[li], rd[ri])
						}
					}
				}
			}
		}
	}
}

// TestTPMapRefusesWhatCannotMap: TP sizes that do not shard the model's KV heads, or of which
// neither is a multiple of the other, fail the handshake with ErrIncompatible naming the sizes.
func TestTPMapRefusesWhatCannotMap(t *testing.T) {
	for _, c := range []struct{ total, local, lh, remote, rh int }{
		{4, 2, 2, 3, 1},  // 3 ranks do not shard 4 heads
		{6, 2, 3, 3, 2},  // 2 and 3: neither a multiple of the other
		{2, 2, 1, 4, 2},  // a producer claiming 2 heads per rank at TP 4 of 2 heads
		{4, 8, 1, 16, 4}, // the producer's heads per rank do not match its TP
	} {
		_, err := newTPMap(c.local, c.lh, c.remote, c.rh, c.total)
		if !errors.Is(err, ErrIncompatible) || !strings.Contains(err.Error(), fmt.Sprintf("TP %d", c.remote)) {
			t.Errorf("%+v: %v, want ErrIncompatible naming TP %d", c, err, c.remote)
		}
	}
}
