package kernel

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

// checkRuns fails unless runs(t) for t < tasks cover [0, panels) once, in order, each run
// non-empty and starting on a multiple of align, and the last tail runs are width panels each.
func checkRuns(t *testing.T, name string, tasks, panels, tail, width, align int, runs func(t int) (p0, p1 int)) {
	t.Helper()
	next := 0
	for i := range tasks {
		p0, p1 := runs(i)
		if p0 != next || p1 <= p0 || p0%align != 0 && i < tasks-tail {
			t.Fatalf("%s: run %d is [%d, %d), want it to start at %d (on a multiple of %d) and hold a panel", name, i, p0, p1, next, align)
		}
		if i >= tasks-tail && p1-p0 != width {
			t.Fatalf("%s: tail run %d is [%d, %d), want %d panels", name, i, p0, p1, width)
		}
		next = p1
	}
	if next != panels {
		t.Fatalf("%s: runs end at panel %d, want %d", name, next, panels)
	}
}

// TestOneRowRunsCoverPanels: a one-row product's tasks, which end with short runs so the
// workers finish together, still cover every panel exactly once, in runs the wide kernels
// take whole (4 panels for bfloat16, pairs for int8), for any number of panels and workers.
func TestOneRowRunsCoverPanels(t *testing.T) {
	for workers := 1; workers <= 4; workers++ {
		for panels := 1; panels <= 120; panels++ {
			for _, group := range []int{1, 2, 4, 8} {
				s := schedule{tiles: 1, panels: panels, tileGroup: 1, tileGroups: 1, panelGroup: min(group, panels)}
				s.panelGroups = (panels + s.panelGroup - 1) / s.panelGroup
				s.widePanels()
				s.endWithSingles(workers)
				name := fmt.Sprintf("bfloat16 %d panels, group %d, %d workers", panels, group, workers)
				if panels >= s.panelGroup+2*workers && s.panelGroup > 1 && s.tail != 2*workers {
					t.Fatalf("%s: tail %d, want %d single panels", name, s.tail, 2*workers)
				}
				checkRuns(t, name, s.tasks(), panels, s.tail, 1, min(s.panelGroup, 4), func(i int) (int, int) {
					_, _, p0, p1 := s.ranges(i)
					return p0, p1
				})
			}
			l := &Linear{panels: panels, i8: &int8Weights{groups: 1}}
			p := l.int8Plan(1, workers)
			name := fmt.Sprintf("int8 %d panels, %d workers", panels, workers)
			if panels >= 8*workers && p.tail != 2*workers {
				t.Fatalf("%s: tail %d, want %d pairs", name, p.tail, 2*workers)
			}
			checkRuns(t, name, p.tasks(), panels, p.tail, 2, 2, func(i int) (int, int) {
				_, _, p0, p1 := p.ranges(i, panels)
				return p0, p1
			})
		}
	}
}

// TestOneRowTailsMatchChain: one-row products large enough to end with short runs (Qwen3-0.6B's
// o_proj and down_proj widths, a partial last panel) give every output the bits of the chain on
// pools of 1–3 workers: bfloat16 products, bfloat16 weights widened to float32, and int8.
func TestOneRowTailsMatchChain(t *testing.T) {
	r := rand.New(rand.NewPCG(61, 62))
	var pools []*Pool
	for n := 1; n <= 3; n++ {
		pools = append(pools, NewPool(n))
	}
	t.Cleanup(func() {
		for _, p := range pools {
			p.Close()
		}
	})
	for _, sh := range [][2]int{{1041, 1024}, {1024, 3072}} {
		out, in := sh[0], sh[1]
		w, row := randSlice(r, out*in), randSlice(r, in)
		h, wide := to16(w, BF16)
		for _, im := range candidateImpls() {
			want, wantDot := make([]float32, out), make([]float32, out)
			for n := range out {
				want[n] = chainRef(im, row, wide[n*in:(n+1)*in])
				wantDot[n] = dotChainRef(row, w[n*in:(n+1)*in])
			}
			for _, p := range pools {
				for _, dot := range []bool{false, true} {
					l := newLinear16(im, p, BF16, out, in, func(n int, dst []uint16) { copy(dst, h[n*in:(n+1)*in]) })
					l.bf16Dot = dot
					got := make([]float32, out)
					l.Apply(got, row, 1)
					ref := want
					if dot {
						ref = wantDot
					}
					for n := range out {
						if math.Float32bits(got[n]) != math.Float32bits(ref[n]) {
							t.Fatalf("%s %dx%d, %d workers, bfloat16 products %v: col %d: %v, chain %v", im.name, out, in, p.Workers(), dot, n, got[n], ref[n])
						}
					}
				}
			}
		}
		tiles := int8Tiles()
		want := applyInt8With(tiles[0], nil, w, row, out, in, 1)
		for _, tile := range tiles {
			for _, p := range pools {
				got := applyInt8With(tile, p, w, row, out, in, 1)
				for n := range out {
					if math.Float32bits(got[n]) != math.Float32bits(want[n]) {
						t.Fatalf("int8 %dx%d, %d workers: col %d: %v, portable alone %v", out, in, p.Workers(), n, got[n], want[n])
					}
				}
			}
		}
	}
}
