package kernel

import (
	"math"
	"math/rand/v2"
	"testing"
)

// TestTileDotTallMatchesChain: the tall whole-panel tiles compute every element as the portable
// chain does, for every height they take, pair counts around the unrolling, partial panels, and
// chains continued from c over a split of k; they write no column past ncols.
func TestTileDotTallMatchesChain(t *testing.T) {
	r := rand.New(rand.NewPCG(47, 48))
	for _, im := range candidateImpls() {
		if im.tileDotTall == nil {
			continue
		}
		for mr := im.mr + 1; mr <= im.tallRows; mr++ {
			for _, kp := range []int{1, 3, 4, 5, 9, 70} {
				const lda, ldc = 75, 70 // strides past a row's pairs and the panel's columns
				a, w := randTileInputs(r, mr, lda, kp)
				want := make([]float32, mr*ldc)
				tileDotGeneric(want, ldc, a, lda, w, kp, mr, panelWidth, nil, false)
				for _, ncols := range []int{64, 49, 17, 1} {
					for _, split := range []int{0, kp / 2} {
						got := make([]float32, mr*ldc)
						for i := range got {
							got[i] = -7
						}
						if split > 0 {
							im.tileDotTall(got, ldc, a, lda, w, split, mr, ncols, w[:64], false)
							im.tileDotTall(got, ldc, a[split:], lda, w[split*2*panelWidth:], kp-split, mr, ncols, w[64:], true)
						} else {
							im.tileDotTall(got, ldc, a, lda, w, kp, mr, ncols, w, false)
						}
						for m := range mr {
							for j := range ldc {
								g, in := got[m*ldc+j], j < ncols
								if in && math.Float32bits(g) != math.Float32bits(want[m*ldc+j]) {
									t.Fatalf("%s rows %d pairs %d cols %d split %d: row %d col %d = %v, chain %v", im.name, mr, kp, ncols, split, m, j, g, want[m*ldc+j])
								}
								if !in && g != -7 {
									t.Fatalf("%s rows %d pairs %d cols %d: wrote row %d col %d", im.name, mr, kp, ncols, m, j)
								}
							}
						}
					}
				}
			}
		}
	}
}
