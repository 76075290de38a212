//go:build amd64 && !purego

package kernel

import "golang.org/x/sys/cpu"

//go:generate go run int8gen.go

// hasInt8Asm reports AVX-512 VNNI (VPDPBUSD), with the AVX-512 the tile kernels also use.
func hasInt8Asm() bool { return hasAVX512() && cpu.X86.HasAVX512VNNI }

// defaultInt8Tile is the int8 tile kernel of this process, chosen once at start.
var defaultInt8Tile = func() int8TileFunc {
	if hasInt8Asm() {
		return tileInt8VNNI
	}
	return tileInt8Generic
}()

//go:noescape
func tileI8x1(a *int8, lda int, d *float32, corr *int32, lds int, w *byte, groups int, c *float32, ldc int, mask uint64)

//go:noescape
func tileI8x2(a *int8, lda int, d *float32, corr *int32, lds int, w *byte, groups int, c *float32, ldc int, mask uint64)

//go:noescape
func tileI8x3(a *int8, lda int, d *float32, corr *int32, lds int, w *byte, groups int, c *float32, ldc int, mask uint64)

//go:noescape
func tileI8x1p2(a *int8, d *float32, corr *int32, w *byte, groups int, c *float32)

// tileInt8VNNI checks bounds, then runs the VPDPBUSD kernel for mr rows; columns ≥ ncols are
// masked off at the store. One row over two whole panels (ncols = 2·panelWidth) runs the
// two-panel kernel.
func tileInt8VNNI(c []float32, ldc int, a int8Acts, w []byte, groups, mr, ncols int) {
	if groups == 0 || mr < 1 || mr > int8TileRows || ncols > panelWidth && mr != 1 {
		tileInt8Generic(c, ldc, a, w, groups, mr, ncols)
		return
	}
	if ncols > panelWidth {
		_ = a.q[groups*Int8Group-1]
		_ = a.d[groups-1]
		_ = a.corr[groups-1]
		_ = w[2*groups*int8GroupBytes-1]
		_ = c[2*panelWidth-1]
		tileI8x1p2(&a.q[0], &a.d[0], &a.corr[0], &w[0], groups, &c[0])
		return
	}
	_ = a.q[(mr-1)*a.ldq+groups*Int8Group-1]
	_ = a.d[(mr-1)*a.lds+groups-1]
	_ = a.corr[(mr-1)*a.lds+groups-1]
	_ = w[groups*int8GroupBytes-1]
	_ = c[(mr-1)*ldc+ncols-1]
	mask := ^uint64(0) >> (panelWidth - ncols)
	k := [int8TileRows]func(a *int8, lda int, d *float32, corr *int32, lds int, w *byte, groups int, c *float32, ldc int, mask uint64){tileI8x1, tileI8x2, tileI8x3}[mr-1]
	k(&a.q[0], a.ldq, &a.d[0], &a.corr[0], a.lds, &w[0], groups, &c[0], ldc, mask)
}

// int8Tiles lists the int8 tile kernels usable here, portable Go first (for tests).
func int8Tiles() []int8TileFunc {
	if hasInt8Asm() {
		return []int8TileFunc{tileInt8Generic, tileInt8VNNI}
	}
	return []int8TileFunc{tileInt8Generic}
}
