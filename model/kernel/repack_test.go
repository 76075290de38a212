package kernel

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

// TestSetRowsAndColumnsPackLikeNewLinear re-packs one Linear through a sequence of shapes
// (growing and shrinking its storage, over stale contents) and checks that the packed panels —
// padding included — and Apply's outputs are bit-identical to a freshly built Linear's.
func TestSetRowsAndColumnsPackLikeNewLinear(t *testing.T) {
	shapes := [][2]int{ // out, in
		{64, 64}, {5, 64}, {16, 16}, {17, 33}, {1, 1}, {130, 96}, {64, 7}, {48, 100}, {200, 31},
		{3, 0}, {0, 5}, {128, 64}, {64, 128}, {33, 65},
	}
	r := rand.New(rand.NewPCG(21, 22))
	for _, im := range candidateImpls() {
		t.Run(im.name, func(t *testing.T) {
			var byRows, byCols Linear
			byRows.impl, byCols.impl = im, im
			for _, sh := range shapes {
				out, in := sh[0], sh[1]
				w := randSlice(r, out*in)
				want := newLinear(im, nil, out, in, w, nil)
				// Rows live in separate allocations with a gap, like rows of a paged store.
				rows := make([][]float32, out)
				for n := range rows {
					rows[n] = append(randSlice(r, 3)[:0:0], w[n*in:(n+1)*in]...)
					rows[n] = append(rows[n], 9, 9, 9)
				}
				next := 0
				byRows.SetRows(nil, out, in, func(n int) []float32 {
					if n != next {
						t.Fatalf("row %d requested, want %d", n, next)
					}
					next++
					return rows[n]
				})
				if next != out {
					t.Fatalf("%d rows requested, want %d", next, out)
				}
				cols := make([][]float32, in)
				for k := range cols {
					for n := range out {
						cols[k] = append(cols[k], w[n*in+k])
					}
					cols[k] = append(cols[k], 7)
				}
				byCols.SetColumns(nil, out, in, func(k int) []float32 { return cols[k] })
				for name, got := range map[string]*Linear{"SetRows": &byRows, "SetColumns": &byCols} {
					if got.Out() != out || got.In() != in || got.panels != want.panels {
						t.Fatalf("%s %dx%d: shape %dx%d, %d panels", name, out, in, got.Out(), got.In(), got.panels)
					}
					if !slices.Equal(bits(got.w), bits(want.w)) {
						t.Fatalf("%s %dx%d: packed panels differ from NewLinear's", name, out, in)
					}
					const rowsX = 7
					x := randSlice(r, rowsX*in)
					a, b := make([]float32, rowsX*out), make([]float32, rowsX*out)
					got.Apply(a, x, rowsX)
					want.Apply(b, x, rowsX)
					if !slices.Equal(bits(a), bits(b)) {
						t.Fatalf("%s %dx%d: Apply differs", name, out, in)
					}
				}
			}
		})
	}
}

func TestTransposeBlocks(t *testing.T) {
	r := rand.New(rand.NewPCG(23, 24))
	for _, im := range candidateImpls() {
		g := im.tgroup
		if g == 0 {
			continue
		}
		for _, blocks := range []int{0, 1, 3} {
			t.Run(fmt.Sprintf("%s/%d", im.name, blocks), func(t *testing.T) {
				var ptrs [16]*float32
				src := make([][]float32, g)
				for i := range g {
					src[i] = randSlice(r, blocks*g+1)
					ptrs[i] = &src[i][0]
				}
				const ldd = 37
				dst := randSlice(r, blocks*g*ldd+g)
				orig := slices.Clone(dst)
				im.transpose(&dst[0], ldd, &ptrs, blocks)
				for k := range blocks * g {
					for i := range g {
						if math.Float32bits(dst[k*ldd+i]) != math.Float32bits(src[i][k]) {
							t.Fatalf("dst[%d][%d] = %v, want src[%d][%d] = %v", k, i, dst[k*ldd+i], i, k, src[i][k])
						}
					}
					for i := g; i < ldd && k*ldd+i < len(dst); i++ {
						if math.Float32bits(dst[k*ldd+i]) != math.Float32bits(orig[k*ldd+i]) {
							t.Fatalf("dst[%d][%d] written", k, i)
						}
					}
				}
			})
		}
	}
}

func bits(x []float32) []uint32 {
	b := make([]uint32, len(x))
	for i, v := range x {
		b[i] = math.Float32bits(v)
	}
	return b
}
