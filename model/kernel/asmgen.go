//go:build ignore

// asmgen writes kernel_amd64.s, the amd64 assembly kernels. Run it with `go generate` (see
// impl_amd64.go) after changing it; the generated file is checked in.
package main

import (
	"bytes"
	"fmt"
	"log"
	"os"
	"strings"
)

var out bytes.Buffer

func p(format string, args ...any) { fmt.Fprintf(&out, "\t"+format+"\n", args...) }
func label(l string)               { fmt.Fprintf(&out, "%s:\n", l) }
func text(sig, frame string) {
	name, _, _ := strings.Cut(sig, "(")
	fmt.Fprintf(&out, "\n// func %s\nTEXT ·%s(SB), NOSPLIT, %s\n", sig, name, frame)
}

const maxRows = 6 // rows per tile in both tile kernels

// maxHalfRows is the most rows of a half-panel tile (tileDot512hN): 2·12
// accumulators, as a whole-panel tile's 4·6.
const maxHalfRows = 12

// row8Base is the register the tiles of more than 8 rows keep row 8's address in (rows 4–7 are
// at SI, rows 0–3 at DI).
const row8Base = "DX"

// rowAddr returns the address of row m (m < 8; m < 12 with r0 = DI, where rows 8–11 are at
// row8Base) of a row-major matrix, given base registers r0 (row 0) and r4 (row 4), the row
// stride s and 3·stride s3, all in bytes, plus a displacement.
func rowAddr(m int, r0, r4, s, s3 string, disp int) string {
	d := ""
	if disp != 0 {
		d = fmt.Sprint(disp)
	}
	base := []string{r0, r4, row8Base}[m/4]
	if m >= 8 && r0 != "DI" || m >= maxHalfRows {
		panic("row")
	}
	switch m % 4 {
	case 0:
		return fmt.Sprintf("%s(%s)", d, base)
	case 1:
		return fmt.Sprintf("%s(%s)(%s*1)", d, base, s)
	case 2:
		return fmt.Sprintf("%s(%s)(%s*2)", d, base, s)
	default:
		return fmt.Sprintf("%s(%s)(%s*1)", d, base, s3)
	}
}

// advanceRows moves the row pointers DI and SI (and row8Base for more than 8 rows) on by n bytes.
func advanceRows(mr, n int) {
	p("ADDQ $%d, DI", n)
	p("ADDQ $%d, SI", n)
	if mr > 8 {
		p("ADDQ $%d, %s", n, row8Base)
	}
}

// rowBases sets SI (row 4) and, for more than 8 rows, row8Base (row 8) from DI (row 0) and the
// row stride R8 in bytes.
func rowBases(mr int) {
	p("LEAQ (DI)(R8*4), SI")
	if mr > 8 {
		p("LEAQ (SI)(R8*4), %s", row8Base)
	}
}

// Weight storage kinds of the tile kernels (see Linear's packing in linear.go).
const (
	wF32  = iota // panel row k: 64 float32 (256 bytes)
	wBF16        // panel row-pair k/2: 64 columns × (bf16 of k even, bf16 of k odd) (256 bytes per pair)
	wF16         // panel row k: 64 halves (128 bytes)
)

// tileName names the tile kernel for mr rows of weights of kind wk.
func tileName(wk, mr int) string {
	return fmt.Sprintf("tile512%sx%d", []string{"", "bf16", "f16"}[wk], mr)
}

// tile512 computes mr rows × 64 columns (one packed panel) with zmm registers:
// accumulators Z0..Z23 (row m, vector v in Z(4m+v)), panel row in Z24..Z27, broadcasts in Z28/Z29.
// Every accumulator lane is one output element: zero, then one VFMADD231PS per k, k ascending,
// with the weight widened exactly to float32 first (bf16: shifted into the upper half of a
// float32; f16: VCVTPH2PS). bf16 panels hold pairs of k: Z24..Z27 get the raw pairs, Z28..Z31
// the even k widened, then the odd k, and the FMAs broadcast x straight from memory.
//
// The 16-bit kernels also take pf, pfoff, pfstep and cont, as tileDot512 does: with two or more
// rows each step (pair of k for bf16, k for f16) prefetches a line at pf and one at pf+pfoff, pf
// moving on by pfstep bytes a step (prefetch2), so that the next panel streams
// from memory while this one is computed from the cache; with cont nonzero the accumulators
// start from c's values (under the column mask), continuing the chains of an earlier call over
// the preceding k.
//
// bf16 tiles of two or more rows broadcast each x into a register (Z28/Z29) and widen the
// weights straight from memory (VPSLLD, VPANDD with the hi16 mask in Z30; the panel's pair, read
// twice, is in L1 the second time): 20 loads per pair of k instead of 52 with the FMAs'
// broadcasts from memory, which ran at 0.8 of the FMA peak against 1.0 now (6 and 4 rows, panels
// in L2, thread CPU time). The one-row tile keeps its memory broadcasts (a memory-bound stream).
func tile512(wk, mr, unroll int) {
	name := tileName(wk, mr)
	reg := wk == wBF16 && mr > 1
	if wk == wF32 {
		text(name+"(a *float32, lda int, w *float32, k int, c *float32, ldc int, mask uint64)", "$0-56")
		for i := 0; i < 4*mr; i++ {
			p("VPXORD Z%d, Z%d, Z%d", i, i, i)
		}
	} else {
		text(name+"(a *float32, lda int, w *uint16, k int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)", "$0-88")
		continuedTile(name, mr, 4)
	}
	prefetch := wk != wF32 && mr > 1
	if reg {
		p("VPBROADCASTD hi16<>(SB), Z30")
	}
	p("MOVQ a+0(FP), DI")
	p("MOVQ lda+8(FP), R8")
	p("SHLQ $2, R8")
	p("LEAQ (R8)(R8*2), R9")
	rowBases(mr)
	p("MOVQ w+16(FP), BX")
	p("MOVQ k+24(FP), CX")
	kstep, wstep := 1, 256 // k per step, weight bytes per step
	switch wk {
	case wBF16:
		kstep = 2
	case wF16:
		wstep = 128
	}
	// step emits the FMAs of step j of an unrolled group (k = kstep·j, …); even only: the
	// last, unpaired k of a bf16 panel.
	step := func(j int, evenOnly bool) {
		switch wk {
		case wF32, wF16:
			for v := range 4 {
				if wk == wF32 {
					p("VMOVUPS %d(BX), Z%d", j*wstep+v*64, 24+v)
				} else {
					p("VCVTPH2PS %d(BX), Z%d", j*wstep+v*32, 24+v)
				}
			}
			if prefetch {
				prefetch2()
			}
			for m := range mr {
				b := 28 + m%2
				p("VBROADCASTSS %s, Z%d", rowAddr(m, "DI", "SI", "R8", "R9", 4*j), b)
				for v := range 4 {
					p("VFMADD231PS Z%d, Z%d, Z%d", 24+v, b, 4*m+v)
				}
			}
		case wBF16:
			if reg {
				for half := range 2 {
					if half == 1 && evenOnly {
						break
					}
					for v := range 4 {
						if half == 0 {
							p("VPSLLD $16, %d(BX), Z%d", j*wstep+v*64, 24+v)
						} else {
							p("VPANDD %d(BX), Z30, Z%d", j*wstep+v*64, 24+v)
						}
					}
					if prefetch && half == 0 {
						prefetch2()
					}
					for m := range mr {
						b := 28 + m%2
						p("VBROADCASTSS %s, Z%d", rowAddr(m, "DI", "SI", "R8", "R9", 4*(2*j+half)), b)
						for v := range 4 {
							p("VFMADD231PS Z%d, Z%d, Z%d", 24+v, b, 4*m+v)
						}
					}
				}
				return
			}
			for v := range 4 {
				p("VMOVDQU32 %d(BX), Z%d", j*wstep+v*64, 24+v)
			}
			if prefetch {
				prefetch2()
			}
			for half := range 2 {
				if half == 1 && evenOnly {
					break
				}
				for v := range 4 {
					if half == 0 {
						p("VPSLLD $16, Z%d, Z%d", 24+v, 28+v)
					} else {
						p("VPANDD.BCST hi16<>(SB), Z%d, Z%d", 24+v, 28+v)
					}
				}
				for m := range mr {
					for v := range 4 {
						p("VFMADD231PS.BCST %s, Z%d, Z%d", rowAddr(m, "DI", "SI", "R8", "R9", 4*(2*j+half)), 28+v, 4*m+v)
					}
				}
			}
		}
	}
	p("CMPQ CX, $%d", unroll*kstep)
	p("JLT %s_tail", name)
	label(name + "_loop")
	for j := range unroll {
		step(j, false)
	}
	p("ADDQ $%d, BX", wstep*unroll)
	advanceRows(mr, 4*kstep*unroll)
	p("SUBQ $%d, CX", kstep*unroll)
	p("CMPQ CX, $%d", kstep*unroll)
	p("JGE %s_loop", name)
	label(name + "_tail")
	p("CMPQ CX, $%d", kstep)
	p("JLT %s_last", name)
	step(0, false)
	p("ADDQ $%d, BX", wstep)
	advanceRows(mr, 4*kstep)
	p("SUBQ $%d, CX", kstep)
	p("JMP %s_tail", name)
	label(name + "_last")
	if wk == wBF16 {
		p("TESTQ CX, CX")
		p("JEQ %s_store", name)
		step(0, true)
	}
	label(name + "_store")
	columnMasks("mask+48(FP)")
	cTile(mr, 4, "c+32(FP)", "ldc+40(FP)", false)
	p("VZEROUPPER")
	p("RET")
}

// tile512bf16x1p computes one row over np (2 or 4) consecutive whole BF16 panels at once (64·np
// columns; panel i ceil(k/2)·256 bytes after panel i−1) in float32, as tile512bf16x1 does one:
// chains Z(4i+v) for panel i; per panel and pair of k its raw pairs go to Z16..Z19 and the
// widened weights to Z20..Z23 (the register renamer lets the panels overlap). Each lane is the
// same chain as in tile512bf16x1 (even k, then odd k, k ascending).
func tile512bf16x1p(np int) {
	name := fmt.Sprintf("tile512bf16x1p%d", np)
	text(name+"(a *float32, w *uint16, k int, c *float32)", "$0-32")
	for i := range 4 * np {
		p("VPXORD Z%d, Z%d, Z%d", i, i, i)
	}
	p("MOVQ a+0(FP), DI")
	p("MOVQ w+8(FP), BX")
	p("MOVQ k+16(FP), CX")
	p("LEAQ 1(CX), AX")
	p("SHRQ $1, AX")
	p("SHLQ $8, AX")
	widePanels(np)
	step := func(j int, evenOnly bool) {
		for i := range np {
			for v := range 4 {
				p("VMOVDQU32 %d(%s), Z%d", j*256+v*64, widePanelRegs[i], 16+v)
			}
			for half := range 2 {
				if half == 1 && evenOnly {
					break
				}
				for v := range 4 {
					if half == 0 {
						p("VPSLLD $16, Z%d, Z%d", 16+v, 20+v)
					} else {
						p("VPANDD.BCST hi16<>(SB), Z%d, Z%d", 16+v, 20+v)
					}
				}
				for v := range 4 {
					p("VFMADD231PS.BCST %d(DI), Z%d, Z%d", 4*(2*j+half), 20+v, 4*i+v)
				}
			}
		}
	}
	advance := func(bytes int) {
		for _, r := range widePanelRegs[:np] {
			p("ADDQ $%d, %s", bytes, r)
		}
	}
	p("CMPQ CX, $8")
	p("JLT %s_tail", name)
	label(name + "_loop")
	for j := range 4 {
		step(j, false)
	}
	advance(1024)
	p("ADDQ $32, DI")
	p("SUBQ $8, CX")
	p("CMPQ CX, $8")
	p("JGE %s_loop", name)
	label(name + "_tail")
	p("CMPQ CX, $2")
	p("JLT %s_last", name)
	step(0, false)
	advance(256)
	p("ADDQ $8, DI")
	p("SUBQ $2, CX")
	p("JMP %s_tail", name)
	label(name + "_last")
	p("TESTQ CX, CX")
	p("JEQ %s_store", name)
	step(0, true)
	label(name + "_store")
	p("MOVQ c+24(FP), DI")
	for v := range 4 * np {
		p("VMOVUPS Z%d, %d(DI)", v, 64*v)
	}
	p("VZEROUPPER")
	p("RET")
}

// columnMasks loads the column mask argument at maskArg ("mask+48(FP)") into K1..K4, 16
// columns each.
func columnMasks(maskArg string) {
	p("MOVQ %s, AX", maskArg)
	for v := range 4 {
		p("KMOVW AX, K%d", v+1)
		if v < 3 {
			p("SHRQ $16, AX")
		}
	}
}

// cTile loads (load) or stores the accumulators Z(vecs·m+v) of an mr × 16·vecs tile of c, the
// pointer argument at cArg with row stride (floats) at ldcArg, under the column masks K1..K4: a
// masked load zeroes the columns it skips. It uses DI, SI, R8, R9 (and row8Base).
func cTile(mr, vecs int, cArg, ldcArg string, load bool) {
	p("MOVQ %s, DI", cArg)
	p("MOVQ %s, R8", ldcArg)
	p("SHLQ $2, R8")
	p("LEAQ (R8)(R8*2), R9")
	rowBases(mr)
	for m := range mr {
		for v := range vecs {
			if load {
				p("VMOVUPS.Z %s, K%d, Z%d", rowAddr(m, "DI", "SI", "R8", "R9", 64*v), v+1, vecs*m+v)
			} else {
				p("VMOVUPS Z%d, K%d, %s", vecs*m+v, v+1, rowAddr(m, "DI", "SI", "R8", "R9", 64*v))
			}
		}
	}
}

// hi16Data is the mask that keeps the upper 16 bits of a dword (the odd bf16 of a pair).
func hi16Data() {
	out.WriteString("DATA hi16<>+0(SB)/4, $0xffff0000\nGLOBL hi16<>(SB), RODATA|NOPTR, $4\n")
}

// tile256 computes mr rows × 16 columns of a packed panel (w points at the first of the 16
// columns; panel rows are 256 bytes apart) with ymm registers: accumulators Y0..Y11, panel row
// in Y12/Y13, broadcasts in Y14/Y15.
func tile256(mr, unroll int) {
	name := fmt.Sprintf("tile256x%d", mr)
	text(name+"(a *float32, lda int, w *float32, k int, c *float32, ldc int)", "$0-48")
	p("MOVQ a+0(FP), DI")
	p("MOVQ lda+8(FP), R8")
	p("SHLQ $2, R8")
	p("LEAQ (R8)(R8*2), R9")
	p("LEAQ (DI)(R8*4), SI")
	p("MOVQ w+16(FP), BX")
	p("MOVQ k+24(FP), CX")
	for i := 0; i < 2*mr; i++ {
		p("VXORPS Y%d, Y%d, Y%d", i, i, i)
	}
	step := func(j int) {
		p("VMOVUPS %d(BX), Y12", j*256)
		p("VMOVUPS %d(BX), Y13", j*256+32)
		for m := range mr {
			b := 14 + m%2
			p("VBROADCASTSS %s, Y%d", rowAddr(m, "DI", "SI", "R8", "R9", 4*j), b)
			p("VFMADD231PS Y12, Y%d, Y%d", b, 2*m)
			p("VFMADD231PS Y13, Y%d, Y%d", b, 2*m+1)
		}
	}
	p("CMPQ CX, $%d", unroll)
	p("JLT %s_tail", name)
	label(name + "_loop")
	for j := range unroll {
		step(j)
	}
	p("ADDQ $%d, BX", 256*unroll)
	p("ADDQ $%d, DI", 4*unroll)
	p("ADDQ $%d, SI", 4*unroll)
	p("SUBQ $%d, CX", unroll)
	p("CMPQ CX, $%d", unroll)
	p("JGE %s_loop", name)
	label(name + "_tail")
	p("TESTQ CX, CX")
	p("JEQ %s_store", name)
	step(0)
	p("ADDQ $256, BX")
	p("ADDQ $4, DI")
	p("ADDQ $4, SI")
	p("DECQ CX")
	p("JMP %s_tail", name)
	label(name + "_store")
	p("MOVQ c+32(FP), DI")
	p("MOVQ ldc+40(FP), R8")
	p("SHLQ $2, R8")
	p("LEAQ (R8)(R8*2), R9")
	p("LEAQ (DI)(R8*4), SI")
	for m := range mr {
		p("VMOVUPS Y%d, %s", 2*m, rowAddr(m, "DI", "SI", "R8", "R9", 0))
		p("VMOVUPS Y%d, %s", 2*m+1, rowAddr(m, "DI", "SI", "R8", "R9", 32))
	}
	p("VZEROUPPER")
	p("RET")
}

// Vector kernels (zmm). Each processes n elements: whole 16-lane chunks, then one masked chunk
// for the n%16 tail that runs the same instructions, so an element's result never depends on
// where it sits. K1 holds the tail mask.
func tailMask(nreg string) {
	p("MOVQ %s, CX", nreg)
	p("ANDQ $15, CX")
	p("MOVQ $1, AX")
	p("SHLQ CX, AX")
	p("DECQ AX")
	p("KMOVW AX, K1")
}

// hsum512 reduces Z0's 16 lanes in a fixed tree into X0's lane 0: halves, quarters, pairs.
func hsum512() {
	p("VEXTRACTF32X8 $1, Z0, Y1")
	p("VADDPS Y1, Y0, Y0")
	p("VEXTRACTF128 $1, Y0, X1")
	p("VADDPS X1, X0, X0")
	p("VPERMILPS $0x4e, X0, X1")
	p("VADDPS X1, X0, X0")
	p("VPERMILPS $0xb1, X0, X1")
	p("VADDPS X1, X0, X0")
}

// hmax512 reduces Z0's 16 lanes to their maximum in X0's lane 0.
func hmax512() {
	p("VEXTRACTF32X8 $1, Z0, Y1")
	p("VMAXPS Y1, Y0, Y0")
	p("VEXTRACTF128 $1, Y0, X1")
	p("VMAXPS X1, X0, X0")
	p("VPERMILPS $0x4e, X0, X1")
	p("VMAXPS X1, X0, X0")
	p("VPERMILPS $0xb1, X0, X1")
	p("VMAXPS X1, X0, X0")
}

func dot512() {
	text("dot512(a, b *float32, n int) float32", "$0-28")
	p("MOVQ a+0(FP), SI")
	p("MOVQ b+8(FP), DI")
	p("MOVQ n+16(FP), DX")
	for i := range 4 {
		p("VPXORD Z%d, Z%d, Z%d", i, i, i)
	}
	p("MOVQ DX, BX")
	p("SHRQ $6, BX")
	p("JZ dot512_16")
	label("dot512_64")
	for v := range 4 {
		p("VMOVUPS %d(SI), Z%d", 64*v, 4+v)
	}
	for v := range 4 {
		p("VFMADD231PS %d(DI), Z%d, Z%d", 64*v, 4+v, v)
	}
	p("ADDQ $256, SI")
	p("ADDQ $256, DI")
	p("DECQ BX")
	p("JNZ dot512_64")
	label("dot512_16")
	p("MOVQ DX, BX")
	p("ANDQ $63, BX")
	p("SHRQ $4, BX")
	p("JZ dot512_tail")
	label("dot512_16loop")
	p("VMOVUPS (SI), Z4")
	p("VFMADD231PS (DI), Z4, Z0")
	p("ADDQ $64, SI")
	p("ADDQ $64, DI")
	p("DECQ BX")
	p("JNZ dot512_16loop")
	label("dot512_tail")
	tailMask("DX")
	p("VMOVUPS.Z (SI), K1, Z4")
	p("VMOVUPS.Z (DI), K1, Z5")
	p("VFMADD231PS Z5, Z4, Z1")
	p("VADDPS Z1, Z0, Z0")
	p("VADDPS Z3, Z2, Z2")
	p("VADDPS Z2, Z0, Z0")
	hsum512()
	p("MOVSS X0, ret+24(FP)")
	p("VZEROUPPER")
	p("RET")
}

// elementwise emits a loop over 16-lane chunks plus a masked tail. load(mask) loads the chunk's
// inputs (mask "" or ", K1" with zeroing), body computes, store(mask) writes.
func elementwise(name string, n string, ptrs []string, load func(z string), body func(), store func(k string)) {
	p("MOVQ %s, BX", n)
	p("SHRQ $4, BX")
	p("JZ %s_tail", name)
	label(name + "_loop")
	load("")
	body()
	store("")
	for _, r := range ptrs {
		p("ADDQ $64, %s", r)
	}
	p("DECQ BX")
	p("JNZ %s_loop", name)
	label(name + "_tail")
	tailMask(n)
	p("KORTESTW K1, K1")
	p("JZ %s_done", name)
	load(".Z")
	body()
	store(", K1")
	label(name + "_done")
	p("VZEROUPPER")
	p("RET")
}

func mask(z string) string {
	if z == "" {
		return ""
	}
	return ", K1"
}

func axpy512() {
	text("axpy512(alpha float32, x, y *float32, n int)", "$0-32")
	p("VBROADCASTSS alpha+0(FP), Z16")
	p("MOVQ x+8(FP), SI")
	p("MOVQ y+16(FP), DI")
	p("MOVQ n+24(FP), DX")
	elementwise("axpy512", "DX", []string{"SI", "DI"},
		func(z string) {
			p("VMOVUPS%s (SI)%s, Z0", z, mask(z))
			p("VMOVUPS%s (DI)%s, Z1", z, mask(z))
		},
		func() { p("VFMADD231PS Z0, Z16, Z1") },
		func(k string) { p("VMOVUPS Z1%s, (DI)", k) })
}

func scale512() {
	text("scale512(alpha float32, x *float32, n int)", "$0-24")
	p("VBROADCASTSS alpha+0(FP), Z16")
	p("MOVQ x+8(FP), DI")
	p("MOVQ n+16(FP), DX")
	elementwise("scale512", "DX", []string{"DI"},
		func(z string) { p("VMOVUPS%s (DI)%s, Z0", z, mask(z)) },
		func() { p("VMULPS Z16, Z0, Z0") },
		func(k string) { p("VMOVUPS Z0%s, (DI)", k) })
}

func add512() {
	text("add512(dst, a, b *float32, n int)", "$0-32")
	p("MOVQ dst+0(FP), DI")
	p("MOVQ a+8(FP), SI")
	p("MOVQ b+16(FP), R8")
	p("MOVQ n+24(FP), DX")
	elementwise("add512", "DX", []string{"DI", "SI", "R8"},
		func(z string) {
			p("VMOVUPS%s (SI)%s, Z0", z, mask(z))
			p("VMOVUPS%s (R8)%s, Z1", z, mask(z))
		},
		func() { p("VADDPS Z1, Z0, Z0") },
		func(k string) { p("VMOVUPS Z0%s, (DI)", k) })
}

// normScale512: dst[i] = (x[i]·inv rounded)·w[i] rounded (RMSNorm's scaling; two VMULPS, as
// the portable loop's two rounded products).
func normScale512() {
	text("normScale512(dst, x, w *float32, inv float32, n int)", "$0-40")
	p("VBROADCASTSS inv+24(FP), Z16")
	p("MOVQ dst+0(FP), DI")
	p("MOVQ x+8(FP), SI")
	p("MOVQ w+16(FP), R8")
	p("MOVQ n+32(FP), DX")
	elementwise("normScale512", "DX", []string{"DI", "SI", "R8"},
		func(z string) {
			p("VMOVUPS%s (SI)%s, Z0", z, mask(z))
			p("VMOVUPS%s (R8)%s, Z1", z, mask(z))
		},
		func() {
			p("VMULPS Z16, Z0, Z0")
			p("VMULPS Z1, Z0, Z0")
		},
		func(k string) { p("VMOVUPS Z0%s, (DI)", k) })
}

// rope512 rotates the pairs (x1[i], x2[i]) by the angles whose cosines and sines are c[i], s[i]:
// x1 = x1·c − x2·s, x2 = x2·c + x1·s, each product and sum rounded (no FMA), as the portable
// loop computes them.
func rope512() {
	text("rope512(x1, x2, c, s *float32, n int)", "$0-40")
	p("MOVQ x1+0(FP), DI")
	p("MOVQ x2+8(FP), SI")
	p("MOVQ c+16(FP), R8")
	p("MOVQ s+24(FP), R9")
	p("MOVQ n+32(FP), DX")
	elementwise("rope512", "DX", []string{"DI", "SI", "R8", "R9"},
		func(z string) {
			p("VMOVUPS%s (DI)%s, Z0", z, mask(z))
			p("VMOVUPS%s (SI)%s, Z1", z, mask(z))
			p("VMOVUPS%s (R8)%s, Z2", z, mask(z))
			p("VMOVUPS%s (R9)%s, Z3", z, mask(z))
		},
		func() {
			p("VMULPS Z2, Z0, Z4") // a·c
			p("VMULPS Z3, Z1, Z5") // b·s
			p("VSUBPS Z5, Z4, Z4") // a·c − b·s
			p("VMULPS Z2, Z1, Z6") // b·c
			p("VMULPS Z3, Z0, Z7") // a·s
			p("VADDPS Z7, Z6, Z6") // b·c + a·s
		},
		func(k string) {
			p("VMOVUPS Z4%s, (DI)", k)
			p("VMOVUPS Z6%s, (SI)", k)
		})
}

// narrowBF16x512 rounds n floats to bfloat16 as F32ToBF16 does — to nearest even, keeping
// denormals, a NaN made quiet (its top bits with 0x40 set) — 16 at a time, the tail under a mask.
func narrowBF16x512() {
	text("narrowBF16x512(dst *uint16, src *float32, n int)", "$0-24")
	p("MOVQ dst+0(FP), DI")
	p("MOVQ src+8(FP), SI")
	p("MOVQ n+16(FP), DX")
	p("MOVL $0x7fff, AX")
	p("VPBROADCASTD AX, Z16")
	p("MOVL $1, AX")
	p("VPBROADCASTD AX, Z17")
	p("MOVL $0x7fffffff, AX")
	p("VPBROADCASTD AX, Z18")
	p("MOVL $0x7f800000, AX")
	p("VPBROADCASTD AX, Z19")
	p("MOVL $0x40, AX")
	p("VPBROADCASTD AX, Z20")
	p("MOVQ DX, BX")
	p("SHRQ $4, BX")
	p("JZ narrowBF16x512_tail")
	body := func() {
		p("VPSRLD $16, Z0, Z1")      // b>>16
		p("VPANDD Z17, Z1, Z2")      // (b>>16)&1
		p("VPADDD Z16, Z0, Z3")      // b + 0x7fff
		p("VPADDD Z2, Z3, Z3")       // + lsb
		p("VPSRLD $16, Z3, Z3")      // rounded
		p("VPANDD Z18, Z0, Z4")      // |b|
		p("VPCMPUD $6, Z19, Z4, K2") // |b| > 0x7f800000: NaN
		p("VPORD Z20, Z1, K2, Z3")   // NaN: b>>16 | 0x40
	}
	label("narrowBF16x512_loop")
	p("VMOVUPS (SI), Z0")
	body()
	p("VPMOVDW Z3, (DI)")
	p("ADDQ $64, SI")
	p("ADDQ $32, DI")
	p("DECQ BX")
	p("JNZ narrowBF16x512_loop")
	label("narrowBF16x512_tail")
	tailMask("DX")
	p("KORTESTW K1, K1")
	p("JZ narrowBF16x512_done")
	p("VMOVUPS.Z (SI), K1, Z0")
	body()
	p("VPMOVDW Z3, K1, (DI)")
	label("narrowBF16x512_done")
	p("VZEROUPPER")
	p("RET")
}

// expConsts loads the exp constants into Z16..Z27.
func expConsts() {
	for i := range 12 {
		p("VBROADCASTSS expc<>+%d(SB), Z%d", 4*i, 16+i)
	}
}

// exp512 replaces Z0 by e^Z0, using Z1, Z2 as temporaries and the constants in Z16..Z27:
// clamp to [-104, 89] (so ±Inf give 0 and +Inf, not NaN), n = round(x·log2 e),
// r = x - n·ln2 (two-step Cody–Waite), e^r by its degree-7 Taylor polynomial (Horner, FMA;
// |r| ≤ ln2/2, truncation error < 1e-8 relative), then VSCALEFPS: p·2^n with correct overflow,
// underflow and subnormal rounding.
func exp512() {
	p("VMAXPS Z26, Z0, Z0")
	p("VMINPS Z27, Z0, Z0")
	p("VMULPS Z16, Z0, Z1")
	p("VRNDSCALEPS $8, Z1, Z1")
	p("VFMADD231PS Z17, Z1, Z0")
	p("VFMADD231PS Z18, Z1, Z0")
	p("VMOVAPS Z19, Z2")
	for c := 20; c <= 25; c++ {
		p("VFMADD213PS Z%d, Z0, Z2", c)
	}
	p("VFMADD213PS Z25, Z0, Z2")
	p("VSCALEFPS Z1, Z2, Z0")
}

func expData() {
	consts := []struct {
		bits uint32
		what string
	}{
		{0x3fb8aa3b, "log2(e)"},
		{0xbf318000, "-ln2 high part (0.693359375)"},
		{0x395e8083, "-ln2 low part (-(-2.12194440e-4))"},
		{0x39500d01, "1/5040"},
		{0x3ab60b61, "1/720"},
		{0x3c088889, "1/120"},
		{0x3d2aaaab, "1/24"},
		{0x3e2aaaab, "1/6"},
		{0x3f000000, "1/2"},
		{0x3f800000, "1"},
		{0xc2d00000, "-104 (lower clamp)"},
		{0x42b20000, "89 (upper clamp)"},
	}
	for i, c := range consts {
		fmt.Fprintf(&out, "DATA expc<>+%d(SB)/4, $0x%08x // %s\n", 4*i, c.bits, c.what)
	}
	fmt.Fprintf(&out, "GLOBL expc<>(SB), RODATA|NOPTR, $%d\n", 4*len(consts))
}

func siluMul512() {
	text("siluMul512(dst, gate, up *float32, n int)", "$0-32")
	p("MOVQ dst+0(FP), DI")
	p("MOVQ gate+8(FP), SI")
	p("MOVQ up+16(FP), R8")
	p("MOVQ n+24(FP), DX")
	expConsts()
	p("VPXORD Z28, Z28, Z28")
	elementwise("siluMul512", "DX", []string{"DI", "SI", "R8"},
		func(z string) {
			p("VMOVUPS%s (SI)%s, Z3", z, mask(z))
			p("VMOVUPS%s (R8)%s, Z4", z, mask(z))
		},
		func() {
			p("VSUBPS Z3, Z28, Z0") // -g
			exp512()
			p("VADDPS Z25, Z0, Z0") // 1 + e^-g
			p("VDIVPS Z0, Z3, Z0")  // g / (1 + e^-g)
			p("VMULPS Z4, Z0, Z0")
		},
		func(k string) { p("VMOVUPS Z0%s, (DI)", k) })
}

// expShift512: x[i] = e^(x[i]-shift); returns the sum, lane-wise (lane i%16) then hsum512.
func expShift512() {
	text("expShift512(x *float32, n int, shift float32) float32", "$0-28")
	p("MOVQ x+0(FP), DI")
	p("MOVQ n+8(FP), DX")
	p("VBROADCASTSS shift+16(FP), Z29")
	expConsts()
	p("VPXORD Z30, Z30, Z30")
	p("MOVQ DX, BX")
	p("SHRQ $4, BX")
	p("JZ expShift512_tail")
	label("expShift512_loop")
	p("VMOVUPS (DI), Z0")
	p("VSUBPS Z29, Z0, Z0")
	exp512()
	p("VMOVUPS Z0, (DI)")
	p("VADDPS Z0, Z30, Z30")
	p("ADDQ $64, DI")
	p("DECQ BX")
	p("JNZ expShift512_loop")
	label("expShift512_tail")
	tailMask("DX")
	p("KORTESTW K1, K1")
	p("JZ expShift512_done")
	p("VMOVUPS.Z (DI), K1, Z0")
	p("VSUBPS Z29, Z0, Z0")
	exp512()
	p("VMOVUPS Z0, K1, (DI)")
	p("VADDPS Z0, Z30, K1, Z30")
	label("expShift512_done")
	p("VMOVAPS Z30, Z0")
	hsum512()
	p("MOVSS X0, ret+24(FP)")
	p("VZEROUPPER")
	p("RET")
}

func max512() {
	text("max512(x *float32, n int) float32", "$0-20")
	p("MOVQ x+0(FP), DI")
	p("MOVQ n+8(FP), DX")
	p("MOVL $0xff800000, AX")
	p("VPBROADCASTD AX, Z0")
	p("VMOVAPS Z0, Z2")
	p("MOVQ DX, BX")
	p("SHRQ $4, BX")
	p("JZ max512_tail")
	label("max512_loop")
	p("VMAXPS (DI), Z0, Z0")
	p("ADDQ $64, DI")
	p("DECQ BX")
	p("JNZ max512_loop")
	label("max512_tail")
	tailMask("DX")
	p("VMOVUPS (DI), K1, Z2")
	p("VMAXPS Z2, Z0, Z0")
	hmax512()
	p("MOVSS X0, ret+16(FP)")
	p("VZEROUPPER")
	p("RET")
}

// fmaLoop512 runs n iterations of 24 independent zmm FMAs (24 accumulators cover two FMA pipes
// with latency up to 12 cycles). 24 × 16 lanes × 2 FLOPs = 768 FLOPs per iteration.
func fmaLoop512() {
	text("fmaLoop512(n int)", "$0-8")
	p("MOVQ n+0(FP), CX")
	for i := range 26 {
		p("VPXORD Z%d, Z%d, Z%d", i, i, i)
	}
	label("fmaLoop512_loop")
	for i := range 24 {
		p("VFMADD231PS Z24, Z25, Z%d", i)
	}
	p("DECQ CX")
	p("JNZ fmaLoop512_loop")
	p("VZEROUPPER")
	p("RET")
}

// fmaLoop256 is fmaLoop512 with ymm registers: 12 accumulators, 12 × 8 × 2 = 192 FLOPs per iteration.
func fmaLoop256() {
	text("fmaLoop256(n int)", "$0-8")
	p("MOVQ n+0(FP), CX")
	for i := range 14 {
		p("VXORPS Y%d, Y%d, Y%d", i, i, i)
	}
	label("fmaLoop256_loop")
	for i := range 12 {
		p("VFMADD231PS Y12, Y13, Y%d", i)
	}
	p("DECQ CX")
	p("JNZ fmaLoop256_loop")
	p("VZEROUPPER")
	p("RET")
}

// readSum256 adds up n floats (n a multiple of 32) with four ymm accumulators; it exists to
// measure read bandwidth.
func readSum256() {
	text("readSum256(x *float32, n int) float32", "$0-20")
	p("MOVQ x+0(FP), SI")
	p("MOVQ n+8(FP), CX")
	p("SHRQ $5, CX")
	for i := range 4 {
		p("VXORPS Y%d, Y%d, Y%d", i, i, i)
	}
	p("TESTQ CX, CX")
	p("JZ readSum256_done")
	label("readSum256_loop")
	for v := range 4 {
		p("VADDPS %d(SI), Y%d, Y%d", 32*v, v, v)
	}
	p("ADDQ $128, SI")
	p("DECQ CX")
	p("JNZ readSum256_loop")
	label("readSum256_done")
	p("VADDPS Y1, Y0, Y0")
	p("VADDPS Y3, Y2, Y2")
	p("VADDPS Y2, Y0, Y0")
	p("VEXTRACTF128 $1, Y0, X1")
	p("VADDPS X1, X0, X0")
	p("MOVSS X0, ret+16(FP)")
	p("VZEROUPPER")
	p("RET")
}

// readSum512 adds up n floats (n a multiple of 128) with eight zmm accumulators; it exists to
// measure read bandwidth.
func readSum512() {
	text("readSum512(x *float32, n int) float32", "$0-20")
	p("MOVQ x+0(FP), SI")
	p("MOVQ n+8(FP), CX")
	p("SHRQ $7, CX")
	for i := range 8 {
		p("VPXORD Z%d, Z%d, Z%d", i, i, i)
	}
	p("TESTQ CX, CX")
	p("JZ readSum512_done")
	label("readSum512_loop")
	for v := range 8 {
		p("VADDPS %d(SI), Z%d, Z%d", 64*v, v, v)
	}
	p("ADDQ $512, SI")
	p("DECQ CX")
	p("JNZ readSum512_loop")
	label("readSum512_done")
	for v := 1; v < 8; v++ {
		p("VADDPS Z%d, Z0, Z0", v)
	}
	hsum512()
	p("MOVSS X0, ret+16(FP)")
	p("VZEROUPPER")
	p("RET")
}

// dot256 is the AVX2 dot product body: n a multiple of 8; four ymm accumulators over 32-element
// chunks, then 8-element chunks into the first, combined as (a0+a1)+(a2+a3) and reduced in a
// fixed tree. The Go wrapper adds the tail.
func dot256() {
	text("dot256(a, b *float32, n int) float32", "$0-28")
	p("MOVQ a+0(FP), SI")
	p("MOVQ b+8(FP), DI")
	p("MOVQ n+16(FP), DX")
	for i := range 4 {
		p("VXORPS Y%d, Y%d, Y%d", i, i, i)
	}
	p("MOVQ DX, BX")
	p("SHRQ $5, BX")
	p("JZ dot256_8")
	label("dot256_32")
	for v := range 4 {
		p("VMOVUPS %d(SI), Y%d", 32*v, 4+v)
	}
	for v := range 4 {
		p("VFMADD231PS %d(DI), Y%d, Y%d", 32*v, 4+v, v)
	}
	p("ADDQ $128, SI")
	p("ADDQ $128, DI")
	p("DECQ BX")
	p("JNZ dot256_32")
	label("dot256_8")
	p("MOVQ DX, BX")
	p("ANDQ $31, BX")
	p("SHRQ $3, BX")
	p("JZ dot256_done")
	label("dot256_8loop")
	p("VMOVUPS (SI), Y4")
	p("VFMADD231PS (DI), Y4, Y0")
	p("ADDQ $32, SI")
	p("ADDQ $32, DI")
	p("DECQ BX")
	p("JNZ dot256_8loop")
	label("dot256_done")
	p("VADDPS Y1, Y0, Y0")
	p("VADDPS Y3, Y2, Y2")
	p("VADDPS Y2, Y0, Y0")
	p("VEXTRACTF128 $1, Y0, X1")
	p("VADDPS X1, X0, X0")
	p("VPERMILPS $0x4e, X0, X1")
	p("VADDPS X1, X0, X0")
	p("VPERMILPS $0xb1, X0, X1")
	p("VADDPS X1, X0, X0")
	p("MOVSS X0, ret+24(FP)")
	p("VZEROUPPER")
	p("RET")
}

// axpy256: y += alpha·x (FMA) over n elements, n a multiple of 8.
func axpy256() {
	text("axpy256(alpha float32, x, y *float32, n int)", "$0-32")
	p("VBROADCASTSS alpha+0(FP), Y8")
	p("MOVQ x+8(FP), SI")
	p("MOVQ y+16(FP), DI")
	p("MOVQ n+24(FP), BX")
	p("SHRQ $3, BX")
	p("JZ axpy256_done")
	label("axpy256_loop")
	p("VMOVUPS (DI), Y0")
	p("VFMADD231PS (SI), Y8, Y0")
	p("VMOVUPS Y0, (DI)")
	p("ADDQ $32, SI")
	p("ADDQ $32, DI")
	p("DECQ BX")
	p("JNZ axpy256_loop")
	label("axpy256_done")
	p("VZEROUPPER")
	p("RET")
}

// exp256 replaces Y0 by e^Y0 (AVX2), using Y1..Y3; constants are 32-byte rows of expc8<>:
// clamp to [-87.33654, 88.02] (so 2^n stays a normal float), n = round(x·log2 e),
// r = x - n·ln2 (two-step), the same degree-7 polynomial as exp512, then p·2^n with 2^n built
// from n's bits; inputs below the lower clamp (including -Inf) give 0.
func exp256() {
	c := func(i int) string { return fmt.Sprintf("expc8<>+%d(SB)", 32*i) }
	p("VCMPPS $1, %s, Y0, Y3", c(10)) // x < lo
	p("VMAXPS %s, Y0, Y0", c(10))
	p("VMINPS %s, Y0, Y0", c(11))
	p("VMULPS %s, Y0, Y1", c(0))
	p("VROUNDPS $0, Y1, Y1")
	p("VFMADD231PS %s, Y1, Y0", c(1))
	p("VFMADD231PS %s, Y1, Y0", c(2))
	p("VMOVUPS %s, Y2", c(3))
	for i := 4; i <= 9; i++ {
		p("VFMADD213PS %s, Y0, Y2", c(i))
	}
	p("VFMADD213PS %s, Y0, Y2", c(9))
	p("VCVTPS2DQ Y1, Y1")
	p("VPADDD %s, Y1, Y1", c(12))
	p("VPSLLD $23, Y1, Y1")
	p("VMULPS Y1, Y2, Y0")
	p("VANDNPS Y0, Y3, Y0")
}

func exp8Data() {
	consts := []uint32{0x3fb8aa3b, 0xbf318000, 0x395e8083, 0x39500d01, 0x3ab60b61, 0x3c088889,
		0x3d2aaaab, 0x3e2aaaab, 0x3f000000, 0x3f800000, 0xc2aeac50, 0x42b00a3d, 127}
	names := []string{"log2(e)", "-ln2 high", "-ln2 low", "1/5040", "1/720", "1/120", "1/24", "1/6", "1/2", "1",
		"-87.33654 (lower clamp)", "88.02 (upper clamp)", "127 (int32 exponent bias)"}
	for i, v := range consts {
		for l := range 8 {
			fmt.Fprintf(&out, "DATA expc8<>+%d(SB)/4, $0x%08x", 32*i+4*l, v)
			if l == 0 {
				fmt.Fprintf(&out, " // %s", names[i])
			}
			out.WriteString("\n")
		}
	}
	fmt.Fprintf(&out, "GLOBL expc8<>(SB), RODATA|NOPTR, $%d\n", 32*len(consts))
}

// siluMul256: dst = g/(1+e^-g)·u over n elements, n a multiple of 8.
func siluMul256() {
	text("siluMul256(dst, gate, up *float32, n int)", "$0-32")
	p("MOVQ dst+0(FP), DI")
	p("MOVQ gate+8(FP), SI")
	p("MOVQ up+16(FP), R8")
	p("MOVQ n+24(FP), BX")
	p("SHRQ $3, BX")
	p("JZ siluMul256_done")
	p("VXORPS Y7, Y7, Y7")
	label("siluMul256_loop")
	p("VMOVUPS (SI), Y4")
	p("VSUBPS Y4, Y7, Y0")
	exp256()
	p("VADDPS expc8<>+288(SB), Y0, Y0")
	p("VDIVPS Y0, Y4, Y0")
	p("VMULPS (R8), Y0, Y0")
	p("VMOVUPS Y0, (DI)")
	p("ADDQ $32, SI")
	p("ADDQ $32, R8")
	p("ADDQ $32, DI")
	p("DECQ BX")
	p("JNZ siluMul256_loop")
	label("siluMul256_done")
	p("VZEROUPPER")
	p("RET")
}

// expShift256: x[i] = e^(x[i]-shift) over n elements (n a multiple of 8); returns the sum,
// lane-wise (lane i%8) then in a fixed tree.
func expShift256() {
	text("expShift256(x *float32, n int, shift float32) float32", "$0-28")
	p("MOVQ x+0(FP), DI")
	p("MOVQ n+8(FP), BX")
	p("VBROADCASTSS shift+16(FP), Y6")
	p("VXORPS Y7, Y7, Y7")
	p("SHRQ $3, BX")
	p("JZ expShift256_done")
	label("expShift256_loop")
	p("VMOVUPS (DI), Y0")
	p("VSUBPS Y6, Y0, Y0")
	exp256()
	p("VMOVUPS Y0, (DI)")
	p("VADDPS Y0, Y7, Y7")
	p("ADDQ $32, DI")
	p("DECQ BX")
	p("JNZ expShift256_loop")
	label("expShift256_done")
	p("VEXTRACTF128 $1, Y7, X1")
	p("VADDPS X1, X7, X0")
	p("VPERMILPS $0x4e, X0, X1")
	p("VADDPS X1, X0, X0")
	p("VPERMILPS $0xb1, X0, X1")
	p("VADDPS X1, X0, X0")
	p("MOVSS X0, ret+24(FP)")
	p("VZEROUPPER")
	p("RET")
}

// transpose512 transposes 16×16 blocks with zmm registers: rows[i] (i < 16) points at source
// row i; for each of blocks column blocks b, columns [16b, 16b+16) of the 16 rows become rows
// [16b, 16b+16) of dst (ldd floats apart), 16 floats each. Pure data movement: unpack within
// 128-bit lanes (ps, then pd), then two rounds of 128-bit lane shuffles.
func transpose512() {
	text("transpose512(dst *float32, ldd int, rows *[16]*float32, blocks int)", "$0-32")
	p("MOVQ dst+0(FP), DI")
	p("MOVQ ldd+8(FP), R8")
	p("SHLQ $2, R8")
	p("MOVQ rows+16(FP), SI")
	p("MOVQ blocks+24(FP), CX")
	p("XORQ AX, AX")
	p("TESTQ CX, CX")
	p("JEQ transpose512_done")
	label("transpose512_loop")
	for i := range 16 {
		p("MOVQ %d(SI), R10", 8*i)
		p("VMOVUPS (R10)(AX*1), Z%d", i)
	}
	transposeRegs16()
	for j := range 16 {
		p("VMOVUPS Z%d, (DI)", j)
		p("ADDQ R8, DI")
	}
	p("ADDQ $64, AX")
	p("DECQ CX")
	p("JNZ transpose512_loop")
	label("transpose512_done")
	p("VZEROUPPER")
	p("RET")
}

// transpose256 is transpose512 for 8×8 blocks with ymm registers (rows[0..8) are used).
func transpose256() {
	text("transpose256(dst *float32, ldd int, rows *[16]*float32, blocks int)", "$0-32")
	p("MOVQ dst+0(FP), DI")
	p("MOVQ ldd+8(FP), R8")
	p("SHLQ $2, R8")
	p("MOVQ rows+16(FP), SI")
	p("MOVQ blocks+24(FP), CX")
	p("XORQ AX, AX")
	p("TESTQ CX, CX")
	p("JEQ transpose256_done")
	label("transpose256_loop")
	for i := range 8 {
		p("MOVQ %d(SI), R10", 8*i)
		p("VMOVUPS (R10)(AX*1), Y%d", i)
	}
	unpackStages("Y", 8, 8)
	for c := range 4 {
		p("VPERM2F128 $0x20, Y%d, Y%d, Y%d", 4+c, c, 8+c)
		p("VPERM2F128 $0x31, Y%d, Y%d, Y%d", 4+c, c, 12+c)
	}
	for j := range 8 {
		p("VMOVUPS Y%d, (DI)", 8+j)
		p("ADDQ R8, DI")
	}
	p("ADDQ $32, AX")
	p("DECQ CX")
	p("JNZ transpose256_loop")
	label("transpose256_done")
	p("VZEROUPPER")
	p("RET")
}

// tileAcc512 is tile512 for a matrix w whose rows are ldw floats apart (not a packed panel),
// continuing from the accumulators in c instead of zero: c[m][j] = c[m][j] + Σ_k a[m][k]·w[k][j]
// as one VFMADD231PS chain per element, k ascending, after loading c[m][j]. Columns ≥ 64 − the
// zero bits of mask are neither read (w, c) nor written.
//
// With bf16 set (tileAccBF16x512), w holds bfloat16 values (ldw of them apart), each widened
// exactly before its FMA (zero-extended and shifted into the upper half of a float32), so the
// chains are those of the same values widened beforehand.
func tileAcc512(bf16 bool, mr, unroll int) {
	name, wt, esz := fmt.Sprintf("tileAcc512x%d", mr), "float32", 4
	if bf16 {
		name, wt, esz = fmt.Sprintf("tileAccBF16x512x%d", mr), "uint16", 2
	}
	text(name+"(a *float32, lda int, w *"+wt+", ldw int, k int, c *float32, ldc int, mask uint64)", "$0-64")
	columnMasks("mask+56(FP)")
	cTile(mr, 4, "c+40(FP)", "ldc+48(FP)", true)
	p("MOVQ a+0(FP), DI")
	p("MOVQ lda+8(FP), R8")
	p("SHLQ $2, R8")
	p("LEAQ (R8)(R8*2), R9")
	p("LEAQ (DI)(R8*4), SI")
	p("MOVQ w+16(FP), BX")
	p("MOVQ ldw+24(FP), R10")
	p("SHLQ $%d, R10", esz/2)
	p("MOVQ k+32(FP), CX")
	step := func(j int) {
		for v := range 4 {
			if bf16 {
				p("VPMOVZXWD.Z %d(BX), K%d, Z%d", v*32, v+1, 24+v)
				p("VPSLLD $16, Z%d, Z%d", 24+v, 24+v)
				continue
			}
			p("VMOVUPS.Z %d(BX), K%d, Z%d", v*64, v+1, 24+v)
		}
		for m := range mr {
			b := 28 + m%2
			p("VBROADCASTSS %s, Z%d", rowAddr(m, "DI", "SI", "R8", "R9", 4*j), b)
			for v := range 4 {
				p("VFMADD231PS Z%d, Z%d, Z%d", 24+v, b, 4*m+v)
			}
		}
		p("ADDQ R10, BX")
	}
	p("CMPQ CX, $%d", unroll)
	p("JLT %s_tail", name)
	label(name + "_loop")
	for j := range unroll {
		step(j)
	}
	p("ADDQ $%d, DI", 4*unroll)
	p("ADDQ $%d, SI", 4*unroll)
	p("SUBQ $%d, CX", unroll)
	p("CMPQ CX, $%d", unroll)
	p("JGE %s_loop", name)
	label(name + "_tail")
	p("TESTQ CX, CX")
	p("JEQ %s_store", name)
	step(0)
	p("ADDQ $4, DI")
	p("ADDQ $4, SI")
	p("DECQ CX")
	p("JMP %s_tail", name)
	label(name + "_store")
	cTile(mr, 4, "c+40(FP)", "ldc+48(FP)", false)
	p("VZEROUPPER")
	p("RET")
}

// rowDots512 computes the dot products of rows query rows with one group of nk ≤ 16 keys:
// dst[r*ldd+j] (j < nk) = one VFMADD231PS chain over d ascending of q[r][d]·key_j[d], from zero,
// where key j starts at k + min(j, nk−1)·ldk floats (the missing keys of a partial group repeat
// the last one; their lanes are never stored). dim is a multiple of 16. For every 16 dimensions
// the 16 keys are loaded and transposed in registers (as in transpose512), so lane j of Z(d)
// holds key_j[d]; each row's 16 lanes then take one FMA per d, the query element broadcast from
// memory. The rows' running sums live in tmp (rows·16 floats) between dimension blocks.
//
// With bf16 set (rowDotsBF16x512), the keys are bfloat16 values (ldk of them apart), each widened
// exactly as it is loaded (zero-extended and shifted into the upper half of a float32), so the
// chains are those of the same keys widened beforehand. R8 then walks the keys' bytes (half of
// AX, which walks the queries').
func rowDots512(bf16 bool) {
	name, kt, ksh := "rowDots512", "float32", 2
	if bf16 {
		name, kt, ksh = "rowDotsBF16x512", "uint16", 1
	}
	rowDotsEntry(name, kt, ksh, bf16)
	label(name + "_block")
	p("MOVQ SI, R10")
	for i := range 16 {
		if bf16 {
			p("VPMOVZXWD (R10)(R8*1), Z%d", i)
			p("VPSLLD $16, Z%d, Z%d", i, i)
		} else {
			p("VMOVUPS (R10)(AX*1), Z%d", i)
		}
		if i < 15 {
			p("LEAQ (R10)(R9*1), R14")
			p("CMPQ R12, $%d", i+1)
			p("CMOVQGT R14, R10")
		}
	}
	transposeRegs16()
	// Z(d) lane j = key_j[16b+d]. One FMA per d for every row, two rows at a time.
	p("LEAQ (BX)(AX*1), R15")
	p("MOVQ R13, R14")
	p("MOVQ rows+32(FP), CX")
	p("CMPQ CX, $2")
	p("JLT " + name + "_row1")
	label(name + "_row2")
	p("VMOVUPS (R14), Z16")
	p("VMOVUPS 64(R14), Z17")
	for d := range 16 {
		p("VFMADD231PS.BCST %d(R15), Z%d, Z16", 4*d, d)
		p("VFMADD231PS.BCST %d(R15)(R11*1), Z%d, Z17", 4*d, d)
	}
	p("VMOVUPS Z16, (R14)")
	p("VMOVUPS Z17, 64(R14)")
	p("ADDQ $128, R14")
	p("LEAQ (R15)(R11*2), R15")
	p("SUBQ $2, CX")
	p("CMPQ CX, $2")
	p("JGE " + name + "_row2")
	label(name + "_row1")
	p("TESTQ CX, CX")
	p("JEQ " + name + "_next")
	p("VMOVUPS (R14), Z16")
	for d := range 16 {
		p("VFMADD231PS.BCST %d(R15), Z%d, Z16", 4*d, d)
	}
	p("VMOVUPS Z16, (R14)")
	label(name + "_next")
	p("ADDQ $64, AX")
	if bf16 {
		p("ADDQ $32, R8")
	}
	p("CMPQ AX, DX")
	p("JLT " + name + "_block")
	rowDotsStore(name)
}

// rowDotsBF16p512 is rowDotsBF16x512 for dim a multiple of 32, transposing the keys' bfloat16
// values in pairs: for every 32 dimensions the 16 keys are loaded 64 bytes each (32 values) and
// transposed as 32-bit elements, so lane j of Z(p) holds the pair key_j[2p], key_j[2p+1]; each
// pair is then widened exactly — the even value shifted into the upper half (VPSLLD $16), the
// odd one with the lower half cleared (VPANDD) — just before its two FMAs per row. The chains
// are rowDotsBF16x512's (d ascending, from zero, the same widened values), with half its
// transposing and widening per dimension: with few query rows (decode's 2 per KV head) those,
// not the FMAs, were what the kernel spent its time on.
func rowDotsBF16p512() {
	name := "rowDotsBF16p512"
	rowDotsEntry(name, "uint16", 1, true)
	label(name + "_block")
	p("MOVQ SI, R10")
	for i := range 16 {
		p("VMOVDQU32 (R10)(R8*1), Z%d", i)
		if i < 15 {
			p("LEAQ (R10)(R9*1), R14")
			p("CMPQ R12, $%d", i+1)
			p("CMOVQGT R14, R10")
		}
	}
	transposeRegs16()
	// Z(p) lane j = key_j[32b+2p] | key_j[32b+2p+1]<<16. Z20 = the odd values' mask.
	p("MOVL $0xffff0000, R14")
	p("VPBROADCASTD R14, Z20")
	p("LEAQ (BX)(AX*1), R15")
	p("MOVQ R13, R14")
	p("MOVQ rows+32(FP), CX")
	p("CMPQ CX, $2")
	p("JLT " + name + "_row1")
	label(name + "_row2")
	p("VMOVUPS (R14), Z16")
	p("VMOVUPS 64(R14), Z17")
	for d := range 16 {
		p("VPSLLD $16, Z%d, Z18", d)
		p("VFMADD231PS.BCST %d(R15), Z18, Z16", 8*d)
		p("VFMADD231PS.BCST %d(R15)(R11*1), Z18, Z17", 8*d)
		p("VPANDD Z20, Z%d, Z19", d)
		p("VFMADD231PS.BCST %d(R15), Z19, Z16", 8*d+4)
		p("VFMADD231PS.BCST %d(R15)(R11*1), Z19, Z17", 8*d+4)
	}
	p("VMOVUPS Z16, (R14)")
	p("VMOVUPS Z17, 64(R14)")
	p("ADDQ $128, R14")
	p("LEAQ (R15)(R11*2), R15")
	p("SUBQ $2, CX")
	p("CMPQ CX, $2")
	p("JGE " + name + "_row2")
	label(name + "_row1")
	p("TESTQ CX, CX")
	p("JEQ " + name + "_next")
	p("VMOVUPS (R14), Z16")
	for d := range 16 {
		p("VPSLLD $16, Z%d, Z18", d)
		p("VFMADD231PS.BCST %d(R15), Z18, Z16", 8*d)
		p("VPANDD Z20, Z%d, Z19", d)
		p("VFMADD231PS.BCST %d(R15), Z19, Z16", 8*d+4)
	}
	p("VMOVUPS Z16, (R14)")
	label(name + "_next")
	p("ADDQ $128, AX")
	p("ADDQ $64, R8")
	p("CMPQ AX, DX")
	p("JLT " + name + "_block")
	rowDotsStore(name)
}

// rowDotsEntry starts a row-dots kernel: it loads the arguments (BX q, R11 ldq bytes, SI k, R9
// ldk << ksh bytes, R12 nk, DX dim bytes of q, R13 tmp), zeroes the rows' running sums in tmp
// and AX (the queries' offset) and, for bfloat16 keys, R8 (the keys' offset).
func rowDotsEntry(name, kt string, ksh int, bf16 bool) {
	text(name+"(dst *float32, ldd int, q *float32, ldq int, rows int, k *"+kt+", ldk int, nk int, dim int, tmp *float32)", "$0-80")
	p("MOVQ q+16(FP), BX")
	p("MOVQ ldq+24(FP), R11")
	p("SHLQ $2, R11")
	p("MOVQ k+40(FP), SI")
	p("MOVQ ldk+48(FP), R9")
	p("SHLQ $%d, R9", ksh)
	p("MOVQ nk+56(FP), R12")
	p("MOVQ dim+64(FP), DX")
	p("SHLQ $2, DX")
	p("MOVQ tmp+72(FP), R13")
	p("VPXORD Z16, Z16, Z16")
	p("MOVQ R13, R14")
	p("MOVQ rows+32(FP), CX")
	label(name + "_zero")
	p("VMOVUPS Z16, (R14)")
	p("ADDQ $64, R14")
	p("DECQ CX")
	p("JNZ " + name + "_zero")
	p("XORQ AX, AX")
	if bf16 {
		p("XORQ R8, R8")
	}
}

// unpackStages emits the first two stages of a transpose of the n rows of 32-bit elements in
// registers r0..r(n-1) (r: "Y" or "Z"), with scratch registers from r(s) on: stage 1 interleaves
// pairs of rows within 128-bit lanes into the scratch; stage 2 interleaves pairs of those pairs
// back into r0..r(n-1), so that r(4g+c) holds, in each 128-bit lane L, rows 4g..4g+3 of the
// lane's column c.
func unpackStages(r string, n, s int) {
	for i := range n / 2 {
		p("VUNPCKLPS %s%d, %s%d, %s%d", r, 2*i+1, r, 2*i, r, s+2*i)
		p("VUNPCKHPS %s%d, %s%d, %s%d", r, 2*i+1, r, 2*i, r, s+2*i+1)
	}
	for g := range n / 4 {
		t := s + 4*g
		p("VUNPCKLPD %s%d, %s%d, %s%d", r, t+2, r, t, r, 4*g)
		p("VUNPCKHPD %s%d, %s%d, %s%d", r, t+2, r, t, r, 4*g+1)
		p("VUNPCKLPD %s%d, %s%d, %s%d", r, t+3, r, t+1, r, 4*g+2)
		p("VUNPCKHPD %s%d, %s%d, %s%d", r, t+3, r, t+1, r, 4*g+3)
	}
}

// transposeRegs16 transposes the 16×16 32-bit elements of Z0–Z15 in place, Z16–Z31 scratch:
// afterwards lane j of Z(d) holds what lane d of Z(j) held.
func transposeRegs16() {
	// Stages 1 and 2: Z(4g+c) lane L holds rows 4g..4g+3 of column 4L+c.
	unpackStages("Z", 16, 16)
	// Stages 3 and 4: gather lane L of Z(c), Z(4+c), Z(8+c), Z(12+c) into column 4L+c.
	for c := range 4 {
		p("VSHUFF32X4 $0x44, Z%d, Z%d, Z%d", 4+c, c, 16+c)
		p("VSHUFF32X4 $0xee, Z%d, Z%d, Z%d", 4+c, c, 20+c)
		p("VSHUFF32X4 $0x44, Z%d, Z%d, Z%d", 12+c, 8+c, 24+c)
		p("VSHUFF32X4 $0xee, Z%d, Z%d, Z%d", 12+c, 8+c, 28+c)
	}
	for c := range 4 {
		p("VSHUFF32X4 $0x88, Z%d, Z%d, Z%d", 24+c, 16+c, c)
		p("VSHUFF32X4 $0xdd, Z%d, Z%d, Z%d", 24+c, 16+c, 4+c)
		p("VSHUFF32X4 $0x88, Z%d, Z%d, Z%d", 28+c, 20+c, 8+c)
		p("VSHUFF32X4 $0xdd, Z%d, Z%d, Z%d", 28+c, 20+c, 12+c)
	}
}

// rowDotsStore ends a row-dots kernel: it stores the nk valid lanes of every row's running sums
// (tmp, R13) into dst.
func rowDotsStore(name string) {
	p("MOVQ $1, AX")
	p("MOVQ R12, CX")
	p("SHLQ CX, AX")
	p("DECQ AX")
	p("KMOVW AX, K1")
	p("MOVQ dst+0(FP), DI")
	p("MOVQ ldd+8(FP), R8")
	p("SHLQ $2, R8")
	p("MOVQ rows+32(FP), CX")
	label(name + "_store")
	p("VMOVUPS (R13), Z16")
	p("VMOVUPS Z16, K1, (DI)")
	p("ADDQ $64, R13")
	p("ADDQ R8, DI")
	p("DECQ CX")
	p("JNZ " + name + "_store")
	p("VZEROUPPER")
	p("RET")
}

// touchLines reads one byte of each cache line of the n bytes from x, in order: demand loads
// that the hardware prefetchers follow ahead, unlike a burst of prefetches, which waits for free
// miss buffers and stalls the work behind it.
func touchLines() {
	text("touchLines(x unsafe.Pointer, n int)", "$0-16")
	p("MOVQ x+0(FP), SI")
	p("MOVQ n+8(FP), CX")
	p("LEAQ (SI)(CX*1), DX")
	p("CMPQ SI, DX")
	p("JGE touchLines_done")
	label("touchLines_loop")
	p("MOVBLZX (SI), AX")
	p("ADDQ $64, SI")
	p("CMPQ SI, DX")
	p("JLT touchLines_loop")
	label("touchLines_done")
	p("RET")
}

// evex512 emits the register form of an EVEX.512.0F38.W0 instruction the Go assembler does not
// know (the AVX512_BF16 ones) as bytes: dst in ModRM.reg, src1 in EVEX.vvvv, src2 in ModRM.rm;
// pp is the mandatory prefix (2: F3, 3: F2). The name is kept as a comment.
func evex512(name string, pp, opcode byte, dst, src1, src2 int) {
	bit := func(r, b int) byte { return byte(r>>b) & 1 }
	p0 := (1-bit(dst, 3))<<7 | (1-bit(src2, 4))<<6 | (1-bit(src2, 3))<<5 | (1-bit(dst, 4))<<4 | 0b10
	p1 := byte(^src1&15)<<3 | 1<<2 | pp
	p2 := byte(2)<<5 | (1-bit(src1, 4))<<3
	modrm := 0xc0 | byte(dst&7)<<3 | byte(src2&7)
	var b []string
	for _, x := range []byte{0x62, p0, p1, p2, opcode, modrm} {
		b = append(b, fmt.Sprintf("BYTE $0x%02x", x))
	}
	p("%s // %s Z%d, Z%d, Z%d", strings.Join(b, "; "), name, src2, src1, dst)
}

// vdpbf16ps emits VDPBF16PS Z(src2), Z(src1), Z(dst): for each of the 16 lanes,
// dst += src1.bf16[2j+1]·src2.bf16[2j+1], then dst += src1.bf16[2j]·src2.bf16[2j].
func vdpbf16ps(dst, src1, src2 int) { evex512("VDPBF16PS", 2, 0x52, dst, src1, src2) }

// vdpbf16psBcst emits VDPBF16PS m32bcst, Z(src1), Z(dst) with the memory operand of row m of
// rowAddr's addressing (base DI or SI, index R8 or R9) plus disp (a multiple of 4, < 512): the
// dword at that address (a pair of bfloat16 activations) is broadcast to every lane. EVEX.b set,
// disp8 compressed by the element size 4.
func vdpbf16psBcst(dst, src1, m, disp int) {
	const di, si, r8, r9 = 7, 6, 8, 9
	base, index, scale := []int{di, di, di, di, si, si}[m], []int{-1, r8, r8, r9, -1, r8}[m], []int{1, 1, 2, 1, 1, 1}[m]
	bit := func(r, b int) byte { return byte(r>>b) & 1 }
	x := byte(0)
	if index >= 0 {
		x = bit(index, 3)
	}
	p0 := (1-bit(dst, 3))<<7 | (1-x)<<6 | (1-bit(base, 3))<<5 | (1-bit(dst, 4))<<4 | 0b10
	p1 := byte(^src1&15)<<3 | 1<<2 | 2
	p2 := byte(2)<<5 | 1<<4 | (1-bit(src1, 4))<<3
	mod := byte(0)
	if disp != 0 {
		mod = 1
	}
	b := []byte{0x62, p0, p1, p2, 0x52}
	if index >= 0 {
		sib := map[int]byte{1: 0, 2: 1, 4: 2, 8: 3}[scale]<<6 | byte(index&7)<<3 | byte(base&7)
		b = append(b, mod<<6|byte(dst&7)<<3|4, sib)
	} else {
		b = append(b, mod<<6|byte(dst&7)<<3|byte(base&7))
	}
	if mod == 1 {
		b = append(b, byte(disp/4))
	}
	var bs []string
	for _, c := range b {
		bs = append(bs, fmt.Sprintf("BYTE $0x%02x", c))
	}
	p("%s // VDPBF16PS.BCST %s, Z%d, Z%d", strings.Join(bs, "; "), rowAddr(m, "DI", "SI", "R8", "R9", disp), src1, dst)
}

// vcvtne2ps2bf16 emits VCVTNE2PS2BF16 Z(src2), Z(src1), Z(dst): words 0–15 of dst are src2's 16
// floats rounded to bfloat16, words 16–31 src1's.
func vcvtne2ps2bf16(dst, src1, src2 int) { evex512("VCVTNE2PS2BF16", 3, 0x72, dst, src1, src2) }

// continuedTile emits the prologue of a tile of vecs·mr accumulators whose args end in (…, c,
// ldc, mask, pf, pfoff, pfstep, cont): with cont = 0 it zeroes the accumulators, else it loads
// them from c (a K block that continues the chains of the one before), then loads pf, pfoff and
// pfstep into R10-R12.
func continuedTile(name string, mr, vecs int) {
	p("MOVQ cont+80(FP), AX")
	p("TESTQ AX, AX")
	p("JNZ %s_cont", name)
	for i := 0; i < vecs*mr; i++ {
		p("VPXORD Z%d, Z%d, Z%d", i, i, i)
	}
	p("JMP %s_start", name)
	label(name + "_cont")
	columnMasks("mask+48(FP)")
	cTile(mr, vecs, "c+32(FP)", "ldc+40(FP)", true)
	label(name + "_start")
	p("MOVQ pf+56(FP), R10")
	p("MOVQ pfoff+64(FP), R11")
	p("MOVQ pfstep+72(FP), R12")
}

// tileDot512 computes mr rows × 64 columns of a BF16 panel with bfloat16 products: a holds the
// rows' activations as bfloat16 pairs (one dword per pair of k, lda dwords per row), w the panel
// (256 bytes per pair of k). Accumulators Z0..Z4mr-1 (row m, vector v in Z(4m+v)), the panel's
// pairs in Z24..Z27; each row's pair is broadcast from memory by the VDPBF16PS itself. Every
// lane is one output element: zero, then one VDPBF16PS per pair of k, k ascending. With two or
// more rows each pair of k also prefetches a line at pf and one at pf+pfoff, pf moving on by
// pfstep bytes a pair (prefetch2; the caller points pf at the share of the next panel this tile
// brings into the cache, so the next panel streams from memory while this one is computed from
// the cache). The one-row kernel (batch-1 decode, a single stream
// through consecutive panels) prefetches nothing: the hardware prefetchers follow its stream,
// and its prefetch per pair (of lines it had already loaded) made the stream 15–20% slower in
// passes over 320 MB of decode-shaped weights alternated with passes without it.
//
// With cont nonzero the accumulators start from c's values instead of zero (under the column
// mask), continuing chains that an earlier call over the preceding pairs of k stored there: a
// float32 goes through memory unchanged, so splitting k into blocks this way changes no bit.
//
// Tiles of two or more rows broadcast each row's pair into a register (Z28/Z29, VPBROADCASTD)
// for its four VDPBF16PS: 10 loads per pair of k instead of 28, which took the 6- and 4-row
// tiles from 0.8 to 1.0 of the VDPBF16PS peak (panels in L2, thread CPU time). The one-row tile
// keeps the memory broadcast.
//
// With vecs = 2 (tileDot512hN) the tile covers half a panel, 32 columns, for up to 12 rows
// (accumulators Z(2m+v)): the caller points w at the half's first pair (the other half 128
// bytes on). A pair's four lines are each read by one half-tile, so rows up to 12 read each
// weight once from the caches, where whole-panel tiles of 6 rows read it twice for 8 rows and
// six times for 32. The same chain per lane.
func tileDot512(mr, vecs, unroll int) {
	name := fmt.Sprintf("tileDot512x%d", mr)
	if vecs == 2 {
		name = fmt.Sprintf("tileDot512h%d", mr)
	}
	reg := mr > 1 || vecs < 4
	text(name+"(a *uint32, lda int, w *uint16, kp int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)", "$0-88")
	continuedTile(name, mr, vecs)
	p("MOVQ a+0(FP), DI")
	p("MOVQ lda+8(FP), R8")
	p("SHLQ $2, R8")
	p("LEAQ (R8)(R8*2), R9")
	rowBases(mr)
	p("MOVQ w+16(FP), BX")
	p("MOVQ kp+24(FP), CX")
	step := func(j int) {
		for v := range vecs {
			p("VMOVDQU32 %d(BX), Z%d", j*256+v*64, 24+v)
		}
		if reg {
			prefetch2()
		}
		for m := range mr {
			if reg {
				p("VPBROADCASTD %s, Z%d", rowAddr(m, "DI", "SI", "R8", "R9", 4*j), 28+m%2)
				for v := range vecs {
					vdpbf16ps(vecs*m+v, 24+v, 28+m%2)
				}
				continue
			}
			for v := range 4 {
				vdpbf16psBcst(4*m+v, 24+v, m, 4*j)
			}
		}
	}
	p("CMPQ CX, $%d", unroll)
	p("JLT %s_tail", name)
	label(name + "_loop")
	for j := range unroll {
		step(j)
	}
	p("ADDQ $%d, BX", 256*unroll)
	advanceRows(mr, 4*unroll)
	p("SUBQ $%d, CX", unroll)
	p("CMPQ CX, $%d", unroll)
	p("JGE %s_loop", name)
	label(name + "_tail")
	p("TESTQ CX, CX")
	p("JEQ %s_store", name)
	step(0)
	p("ADDQ $256, BX")
	advanceRows(mr, 4)
	p("DECQ CX")
	p("JMP %s_tail", name)
	label(name + "_store")
	columnMasks("mask+48(FP)")
	cTile(mr, vecs, "c+32(FP)", "ldc+40(FP)", false)
	p("VZEROUPPER")
	p("RET")
}

// prefetch2 emits a step's prefetches of a multi-row tile: the line at R10 and the line R11
// bytes further (R11 = 0: the same line again, which costs next to nothing), then R10 moves on
// by R12 bytes. The caller chooses the step (at most 64) and the second stream so that its tiles
// together prefetch the next panel (or block) evenly over all their steps.
func prefetch2() {
	p("PREFETCHT0 (R10)")
	p("PREFETCHT0 (R10)(R11*1)")
	p("ADDQ R12, R10")
}

// widePanelRegs are the pointer registers of the one-row kernels' panels: panel i of np at
// widePanelRegs[i] (BX, then BX+stride, …).
var widePanelRegs = []string{"BX", "DX", "R8", "R9"}

// widePanels loads the panel pointers of a one-row kernel: the first panel at w, the next ones
// stride bytes apart (stride held in AX; clobbers AX).
func widePanels(np int) {
	for i := 1; i < np; i++ {
		p("LEAQ (%s)(AX*1), %s", widePanelRegs[i-1], widePanelRegs[i])
	}
}

// tileDot512x1p computes one row over np (2 or 4) consecutive whole panels at once (64·np
// columns; panel i kp·256 bytes after panel i−1): chains Z(4i+v) for panel i, its pairs in
// Z(16+4i+v). Each lane is the same chain as in tileDot512x1 (zero, one VDPBF16PS per pair of k,
// k ascending); np streams and 4·np independent chains keep more of the weights in flight than
// one panel at a time.
func tileDot512x1p(np int) {
	name := fmt.Sprintf("tileDot512x1p%d", np)
	text(name+"(a *uint32, w *uint16, kp int, c *float32)", "$0-32")
	for i := range 4 * np {
		p("VPXORD Z%d, Z%d, Z%d", i, i, i)
	}
	p("MOVQ a+0(FP), DI")
	p("MOVQ w+8(FP), BX")
	p("MOVQ kp+16(FP), CX")
	p("MOVQ CX, AX")
	p("SHLQ $8, AX")
	widePanels(np)
	step := func(j int) {
		for i := range np {
			for v := range 4 {
				p("VMOVDQU32 %d(%s), Z%d", j*256+v*64, widePanelRegs[i], 16+4*i+v)
			}
		}
		for i := range np {
			for v := range 4 {
				vdpbf16psBcst(4*i+v, 16+4*i+v, 0, 4*j)
			}
		}
	}
	advance := func(bytes int) {
		for _, r := range widePanelRegs[:np] {
			p("ADDQ $%d, %s", bytes, r)
		}
	}
	p("CMPQ CX, $4")
	p("JLT %s_tail", name)
	label(name + "_loop")
	for j := range 4 {
		step(j)
	}
	advance(1024)
	p("ADDQ $16, DI")
	p("SUBQ $4, CX")
	p("CMPQ CX, $4")
	p("JGE %s_loop", name)
	label(name + "_tail")
	p("TESTQ CX, CX")
	p("JEQ %s_store", name)
	step(0)
	advance(256)
	p("ADDQ $4, DI")
	p("DECQ CX")
	p("JMP %s_tail", name)
	label(name + "_store")
	p("MOVQ c+24(FP), DI")
	for v := range 4 * np {
		p("VMOVUPS Z%d, %d(DI)", v, 64*v)
	}
	p("VZEROUPPER")
	p("RET")
}

// toBF16Pairs512 rounds n floats to bfloat16 (VCVTNE2PS2BF16: nearest even, denormals to zero)
// into ceil(n/2) dwords of pairs, 32 floats at a time; the tail is loaded under masks (missing
// floats read as zero) and stored under a word mask.
func toBF16Pairs512() {
	text("toBF16Pairs512(dst *uint32, src *float32, n int)", "$0-24")
	p("MOVQ dst+0(FP), DI")
	p("MOVQ src+8(FP), SI")
	p("MOVQ n+16(FP), DX")
	p("MOVQ DX, BX")
	p("SHRQ $5, BX")
	p("JZ toBF16Pairs512_tail")
	label("toBF16Pairs512_loop")
	p("VMOVUPS (SI), Z0")
	p("VMOVUPS 64(SI), Z1")
	vcvtne2ps2bf16(2, 1, 0)
	p("VMOVDQU32 Z2, (DI)")
	p("ADDQ $128, SI")
	p("ADDQ $64, DI")
	p("DECQ BX")
	p("JNZ toBF16Pairs512_loop")
	label("toBF16Pairs512_tail")
	p("ANDQ $31, DX")
	p("JZ toBF16Pairs512_done")
	// K1/K2: the floats left (low and high 16); K3: the words to store (rounded up to a pair).
	p("MOVQ $1, AX")
	p("MOVQ DX, CX")
	p("SHLQ CX, AX")
	p("DECQ AX")
	p("KMOVW AX, K1")
	p("SHRQ $16, AX")
	p("KMOVW AX, K2")
	p("LEAQ 1(DX), CX")
	p("ANDQ $-2, CX")
	p("MOVQ $1, AX")
	p("SHLQ CX, AX")
	p("DECQ AX")
	p("KMOVD AX, K3")
	p("VMOVUPS.Z (SI), K1, Z0")
	p("VMOVUPS.Z 64(SI), K2, Z1")
	vcvtne2ps2bf16(2, 1, 0)
	p("VMOVDQU16 Z2, K3, (DI)")
	label("toBF16Pairs512_done")
	p("VZEROUPPER")
	p("RET")
}

// widenBF16x512 widens n bfloat16 values to float32 (each shifted into the upper half of a
// dword), 16 at a time, the tail under a mask.
func widenBF16x512() {
	text("widenBF16x512(dst *float32, src *uint16, n int)", "$0-24")
	p("MOVQ dst+0(FP), DI")
	p("MOVQ src+8(FP), SI")
	p("MOVQ n+16(FP), DX")
	p("MOVQ DX, BX")
	p("SHRQ $4, BX")
	p("JZ widenBF16x512_tail")
	label("widenBF16x512_loop")
	p("VPMOVZXWD (SI), Z0")
	p("VPSLLD $16, Z0, Z0")
	p("VMOVUPS Z0, (DI)")
	p("ADDQ $32, SI")
	p("ADDQ $64, DI")
	p("DECQ BX")
	p("JNZ widenBF16x512_loop")
	label("widenBF16x512_tail")
	tailMask("DX")
	p("KORTESTW K1, K1")
	p("JZ widenBF16x512_done")
	p("VPMOVZXWD.Z (SI), K1, Z0")
	p("VPSLLD $16, Z0, Z0")
	p("VMOVUPS Z0, K1, (DI)")
	label("widenBF16x512_done")
	p("VZEROUPPER")
	p("RET")
}

// dotBF16Probe runs one VDPBF16PS on 16 lanes from memory (acc += a·b), for tests.
func dotBF16Probe() {
	text("dotBF16Probe(acc *float32, a, b *uint32)", "$0-24")
	p("MOVQ acc+0(FP), DI")
	p("MOVQ a+8(FP), SI")
	p("MOVQ b+16(FP), DX")
	p("VMOVUPS (DI), Z0")
	p("VMOVDQU32 (SI), Z1")
	p("VMOVDQU32 (DX), Z2")
	vdpbf16ps(0, 1, 2)
	p("VMOVUPS Z0, (DI)")
	p("VZEROUPPER")
	p("RET")
}

// dpLoop512 runs n iterations of 24 independent VDPBF16PS (zmm): 24 × 16 lanes × 2 multiply-adds
// × 2 FLOPs = 1536 FLOPs per iteration.
func dpLoop512() {
	text("dpLoop512(n int)", "$0-8")
	p("MOVQ n+0(FP), CX")
	for i := range 26 {
		p("VPXORD Z%d, Z%d, Z%d", i, i, i)
	}
	label("dpLoop512_loop")
	for i := range 24 {
		vdpbf16ps(i, 24, 25)
	}
	p("DECQ CX")
	p("JNZ dpLoop512_loop")
	p("VZEROUPPER")
	p("RET")
}

func main() {
	out.WriteString("// Code generated by asmgen.go; DO NOT EDIT.\n\n//go:build amd64 && !purego\n\n#include \"textflag.h\"\n")
	hi16Data()
	for _, wk := range []int{wF32, wBF16, wF16} {
		for mr := 1; mr <= maxRows; mr++ {
			tile512(wk, mr, 4)
		}
	}
	tile512bf16x1p(2)
	tile512bf16x1p(4)
	for mr := 1; mr <= maxRows; mr++ {
		tile256(mr, 4)
	}
	for _, bf16 := range []bool{false, true} {
		for mr := 1; mr <= maxRows; mr++ {
			tileAcc512(bf16, mr, 4)
		}
	}
	out.WriteString("\n")
	expData()
	dot512()
	axpy512()
	scale512()
	add512()
	normScale512()
	rope512()
	narrowBF16x512()
	siluMul512()
	expShift512()
	max512()
	fmaLoop512()
	fmaLoop256()
	readSum256()
	readSum512()
	dot256()
	axpy256()
	exp8Data()
	siluMul256()
	expShift256()
	transpose512()
	transpose256()
	rowDots512(false)
	rowDots512(true)
	rowDotsBF16p512()
	touchLines()
	for mr := 1; mr <= maxRows; mr++ {
		tileDot512(mr, 4, 4)
	}
	for mr := 1; mr <= maxHalfRows; mr++ {
		tileDot512(mr, 2, 4)
	}
	tileDot512x1p(2)
	tileDot512x1p(4)
	toBF16Pairs512()
	widenBF16x512()
	dotBF16Probe()
	dpLoop512()
	if err := os.WriteFile("kernel_amd64.s", out.Bytes(), 0o644); err != nil {
		log.Fatal(err)
	}
}
