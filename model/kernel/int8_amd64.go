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
func tileI8r1(a *int8, d *float32, corr *int32, w *byte, groups int, c *float32, ldc int, mask uint64, pf *byte, pfn int, cont int)

//go:noescape
func tileI8r2(a *int8, d *float32, corr *int32, w *byte, groups int, c *float32, ldc int, mask uint64, pf *byte, pfn int, cont int)

//go:noescape
func tileI8r3(a *int8, d *float32, corr *int32, w *byte, groups int, c *float32, ldc int, mask uint64, pf *byte, pfn int, cont int)

//go:noescape
func tileI8r4(a *int8, d *float32, corr *int32, w *byte, groups int, c *float32, ldc int, mask uint64, pf *byte, pfn int, cont int)

//go:noescape
func tileI8r5(a *int8, d *float32, corr *int32, w *byte, groups int, c *float32, ldc int, mask uint64, pf *byte, pfn int, cont int)

//go:noescape
func tileI8r6(a *int8, d *float32, corr *int32, w *byte, groups int, c *float32, ldc int, mask uint64, pf *byte, pfn int, cont int)

//go:noescape
func tileI8x1p2(a *int8, d *float32, corr *int32, w *byte, groups int, c *float32)

// tileInt8VNNI checks bounds, then runs the VPDPBUSD kernel for a.mr rows; columns ≥ ncols are
// masked off at the loads and stores of c. One row over two whole panels (ncols = 2·panelWidth)
// runs the two-panel kernel.
func tileInt8VNNI(c []float32, ldc int, a int8Acts, w []byte, groups, ncols int, pf []byte, cont bool) {
	mr := a.mr
	if groups == 0 || mr < 1 || mr > int8TileRows || ncols > panelWidth && (mr != 1 || cont) {
		tileInt8Generic(c, ldc, a, w, groups, ncols, pf, cont)
		return
	}
	_ = a.q[groups*Int8Group*mr-1]
	_ = a.d[groups*mr-1]
	_ = a.corr[groups*mr-1]
	if ncols > panelWidth {
		_ = w[2*groups*int8GroupBytes-1]
		_ = c[2*panelWidth-1]
		tileI8x1p2(&a.q[0], &a.d[0], &a.corr[0], &w[0], groups, &c[0])
		return
	}
	_ = w[groups*int8GroupBytes-1]
	_ = c[(mr-1)*ldc+ncols-1]
	mask := ^uint64(0) >> (panelWidth - ncols)
	var pfp *byte
	if len(pf) > 0 {
		pfp = &pf[0]
	}
	k := 0
	if cont {
		k = 1
	}
	kernels := [int8TileRows]func(a *int8, d *float32, corr *int32, w *byte, groups int, c *float32, ldc int, mask uint64, pf *byte, pfn int, cont int){
		tileI8r1, tileI8r2, tileI8r3, tileI8r4, tileI8r5, tileI8r6}
	kernels[mr-1](&a.q[0], &a.d[0], &a.corr[0], &w[0], groups, &c[0], ldc, mask, pfp, (len(pf)+63)/64, k)
}

// int8Tiles lists the int8 tile kernels usable here, portable Go first (for tests).
func int8Tiles() []int8TileFunc {
	if hasInt8Asm() {
		return []int8TileFunc{tileInt8Generic, tileInt8VNNI}
	}
	return []int8TileFunc{tileInt8Generic}
}

//go:noescape
func quantI8(x *float32, groups int, q *int8, qstride int, d *float32, corr *int32, sstride int) int

// quantizeGroups quantizes row m of the tile a from group g on with quantI8, x being the row's
// inputs from group g to its last whole group, and returns how many groups it did (0 without
// AVX-512 VNNI; quantI8 stops before a group the portable code must do).
func quantizeGroups(a int8Acts, m, g int, x []float32) int {
	n := len(x) / Int8Group
	if n == 0 || !hasInt8Asm() {
		return 0
	}
	_ = a.q[4*8*(g+n)*a.mr-1]
	_ = a.d[(g+n)*a.mr-1]
	_ = a.corr[(g+n)*a.mr-1]
	return quantI8(&x[0], n, &a.q[4*(8*g*a.mr+m)], 4*a.mr, &a.d[g*a.mr+m], &a.corr[g*a.mr+m], 4*a.mr)
}
