//go:build ignore

// int8gen writes int8_amd64.s, the AVX-512 VNNI kernels of int8 Linears (see int8.go). Run it
// with `go generate` (see int8_amd64.go) after changing it; the generated file is checked in.
package main

import (
	"bytes"
	"fmt"
	"log"
	"os"
)

var out bytes.Buffer

func p(format string, args ...any) { fmt.Fprintf(&out, "\t"+format+"\n", args...) }

const (
	group      = 32                    // inputs per scale (Int8Group)
	panel      = 64                    // columns per panel (panelWidth)
	groupBytes = group*panel + 4*panel // weights, then float32 scales
)

// tileRows is the most rows one tile kernel computes: its int32 group sums (four registers a
// row) fill Z0..Z23, the weights Z24..Z27, the activations' broadcasts and the epilogue's
// temporaries Z28..Z30.
const tileRows = 6

// pfLinesPerStep is how many 64-byte lines of the next block a tile prefetches per step of 4
// inputs (while it has any left to prefetch).
const pfLinesPerStep = 3

// text starts the function name, whose Go signature is sig, with an argument frame of frame bytes.
func text(name, sig string, frame int) {
	fmt.Fprintf(&out, "\n// func %s%s\n", name, sig)
	fmt.Fprintf(&out, "TEXT ·%s(SB), NOSPLIT, $0-%d\n", name, frame)
}

// args loads the first arguments, given as pairs of name and register, 8 bytes each.
func args(pairs ...string) {
	for i := 0; i < len(pairs); i += 2 {
		p("MOVQ %s+%d(FP), %s", pairs[i], 4*i, pairs[i+1])
	}
}

// crow returns the address of row m of c (base DI for rows 0–2, SI = DI + 3·ldc for rows 3–5,
// stride R8 bytes) plus disp.
func crow(m, disp int) string {
	base := "DI"
	if m >= 3 {
		base, m = "SI", m-3
	}
	d := ""
	if disp != 0 {
		d = fmt.Sprint(disp)
	}
	switch m {
	case 0:
		return fmt.Sprintf("%s(%s)", d, base)
	case 1:
		return fmt.Sprintf("%s(%s)(R8*1)", d, base)
	}
	return fmt.Sprintf("%s(%s)(R8*2)", d, base)
}

// tile writes tileI8r<mr>: mr rows × 64 columns of one int8 panel over groups groups, the
// activations laid out for the tile (group g, step q, row m: the 4 inputs at word (8g+q)·mr+m of a,
// the row's scale and correction at d[g·mr+m] and corr[g·mr+m]). The float32 chains live in c:
// unless cont, the tile first stores zeros there; each group then takes, per row and
// 16-column vector, s = corr (−128·Σq, as the weights are stored as q+128 for VPDPBUSD's
// unsigned operand) plus 8 VPDPBUSD steps of 4 inputs, and c = c + float32(s)·(dw·dx) — the
// chain's operations and operand order of the portable kernel. Registers: sums Z(4m+v), weights
// and then the weight scales Z24..Z27, the rows' activation broadcasts Z28/Z29 (alternating),
// the row scale Z28, dw·dx Z29, the chain's value loaded from c Z30. While pfn > 0 every step
// prefetches pfLinesPerStep lines from pf on (the tile's share of the next block).
func tile(mr int) {
	name := fmt.Sprintf("tileI8r%d", mr)
	text(name, "(a *int8, d *float32, corr *int32, w *byte, groups int, c *float32, ldc int, mask uint64, pf *byte, pfn int, cont int)", 88)
	args("a", "DX", "d", "R10", "corr", "R11", "w", "BX", "groups", "CX", "c", "DI", "ldc", "R8")
	p("SHLQ $2, R8")
	p("LEAQ (DI)(R8*2), SI")
	p("ADDQ R8, SI")
	p("MOVQ mask+56(FP), AX")
	for v := range 4 {
		p("KMOVW AX, K%d", v+1)
		if v < 3 {
			p("SHRQ $16, AX")
		}
	}
	p("MOVQ pf+64(FP), R9")
	p("MOVQ pfn+72(FP), R12")
	p("CMPQ cont+80(FP), $0")
	p("JNE %s_loop", name)
	p("VPXORD Z30, Z30, Z30")
	for m := range mr {
		for v := range 4 {
			p("VMOVUPS Z30, K%d, %s", v+1, crow(m, 64*v))
		}
	}
	fmt.Fprintf(&out, "%s_loop:\n", name)
	for m := range mr {
		for v := range 4 {
			p("VPBROADCASTD %d(R11), Z%d", 4*m, 4*m+v)
		}
	}
	for q := range group / 4 {
		skip := fmt.Sprintf("%s_pf%d", name, q)
		p("TESTQ R12, R12")
		p("JLE %s", skip)
		for i := range pfLinesPerStep {
			p("PREFETCHT0 %d(R9)", 64*i)
		}
		p("ADDQ $%d, R9", 64*pfLinesPerStep)
		p("SUBQ $%d, R12", pfLinesPerStep)
		fmt.Fprintf(&out, "%s:\n", skip)
		for v := range 4 {
			p("VMOVDQU32 %d(BX), Z%d", q*4*panel+v*64, 24+v)
		}
		for m := range mr {
			x := 28 + m%2
			p("VPBROADCASTD %d(DX), Z%d", 4*(q*mr+m), x)
			for v := range 4 {
				p("VPDPBUSD Z%d, Z%d, Z%d", x, 24+v, 4*m+v)
			}
		}
	}
	for v := range 4 {
		p("VMOVUPS %d(BX), Z%d", group*panel+v*64, 24+v)
	}
	for m := range mr {
		p("VBROADCASTSS %d(R10), Z28", 4*m)
		for v := range 4 {
			s := 4*m + v
			p("VMULPS Z28, Z%d, Z29", 24+v)
			p("VCVTDQ2PS Z%d, Z%d", s, s)
			p("VMULPS Z29, Z%d, Z%d", s, s)
			p("VMOVUPS.Z %s, K%d, Z30", crow(m, 64*v), v+1)
			p("VADDPS Z%d, Z30, Z%d", s, s)
			p("VMOVUPS Z%d, K%d, %s", s, v+1, crow(m, 64*v))
		}
	}
	p("ADDQ $%d, BX", groupBytes)
	p("ADDQ $%d, DX", group*mr)
	p("ADDQ $%d, R10", 4*mr)
	p("ADDQ $%d, R11", 4*mr)
	p("DECQ CX")
	p("JNZ %s_loop", name)
	p("VZEROUPPER")
	p("RET")
}

// tile2 writes tileI8x1p2: one row × two consecutive whole int8 panels (128 columns, the second
// panel groups·groupBytes after the first), the computation of tileI8r1 on each with the chains
// in registers. Registers: int32 group sums Z0..Z3 and Z4..Z7 (first and second panel), float32
// chains Z12..Z15 and Z16..Z19, the first panel's weights and then scales in Z24..Z27, the
// second's in Z20..Z23, temporaries Z28..Z30. Two weight streams and twice the independent chains keep more of the weights in
// flight than one panel at a time.
func tile2() {
	const name = "tileI8x1p2"
	text(name, "(a *int8, d *float32, corr *int32, w *byte, groups int, c *float32)", 48)
	args("a", "DI", "d", "R10", "corr", "R11", "w", "BX", "groups", "CX")
	p("IMUL3Q $%d, CX, DX", groupBytes)
	p("ADDQ BX, DX")
	for i := range 8 {
		p("VPXORD Z%d, Z%d, Z%d", 12+i, 12+i, 12+i)
	}
	fmt.Fprintf(&out, "%s_loop:\n", name)
	p("VPBROADCASTD (R11), Z0")
	for v := 1; v < 8; v++ {
		p("VMOVDQA64 Z0, Z%d", v)
	}
	for q := range group / 4 {
		for v := range 4 {
			p("VMOVDQU32 %d(BX), Z%d", q*4*panel+v*64, 24+v)
			p("VMOVDQU32 %d(DX), Z%d", q*4*panel+v*64, 20+v)
		}
		for v := range 4 {
			p("VPDPBUSD.BCST %d(DI), Z%d, Z%d", 4*q, 24+v, v)
			p("VPDPBUSD.BCST %d(DI), Z%d, Z%d", 4*q, 20+v, 4+v)
		}
	}
	for v := range 4 {
		p("VMOVUPS %d(BX), Z%d", group*panel+v*64, 24+v)
		p("VMOVUPS %d(DX), Z%d", group*panel+v*64, 20+v)
	}
	p("VBROADCASTSS (R10), Z28")
	for half := range 2 {
		for v := range 4 {
			p("VMULPS Z28, Z%d, Z29", 24-4*half+v)
			p("VCVTDQ2PS Z%d, Z30", 4*half+v)
			p("VMULPS Z29, Z30, Z30")
			p("VADDPS Z30, Z%d, Z%d", 12+4*half+v, 12+4*half+v)
		}
	}
	p("ADDQ $%d, BX", groupBytes)
	p("ADDQ $%d, DX", groupBytes)
	p("ADDQ $%d, DI", group)
	p("ADDQ $4, R10")
	p("ADDQ $4, R11")
	p("DECQ CX")
	p("JNZ %s_loop", name)
	p("MOVQ c+40(FP), DI")
	for v := range 8 {
		p("VMOVUPS Z%d, %d(DI)", 12+v, 64*v)
	}
	p("VZEROUPPER")
	p("RET")
}

// quant writes quantI8: the activations' quantizer, QuantizeInt8's rule for whole groups of a
// row (x, groups groups of 32), each group's 32 int8 values stored as 8 words at a stride of
// qstride bytes (the tile layout of int8Acts), its scale and correction (−128·Σq) at a stride
// of sstride bytes. It returns the number of groups it quantized: it stops before a group whose
// largest |x| is not finite or below 2⁻¹⁰³, which the portable code quantizes (its scale's
// reciprocal could overflow), and a group of zeros gets zeros. The rounding is exact: with f =
// x·(1/d), t = trunc(f) and 2·(f−t) exact, t + trunc(2·(f−t)) is f rounded half away from zero,
// as roundInt8 rounds it.
func quant() {
	const name = "quantI8"
	text(name, "(x *float32, groups int, q *int8, qstride int, d *float32, corr *int32, sstride int) int", 64)
	args("x", "SI", "groups", "CX", "q", "DI", "qstride", "R8", "d", "R10", "corr", "R11", "sstride", "R9")
	p("LEAQ (R8*8), R12") // a group's 8 words
	for _, c := range []struct {
		bits uint32
		reg  int
	}{{0x7fffffff, 31}, {0x42fe0000, 30}, {0xc2fe0000, 29}, {0x3f800000, 28}} { // |x| mask, 127, −127, 1
		p("MOVL $0x%08x, AX", c.bits)
		p("VMOVD AX, X%d", c.reg)
		p("VPBROADCASTD X%d, Z%d", c.reg, c.reg)
	}
	p("VMOVD R8, X26")
	p("VPBROADCASTD X26, Y26")
	p("VMOVDQU32 iota8<>(SB), Y27")
	p("VPMULLD Y26, Y27, Y27") // the words' byte offsets
	p("XORQ DX, DX")
	fmt.Fprintf(&out, "%s_loop:\n", name)
	p("CMPQ DX, CX")
	p("JGE %s_done", name)
	p("VMOVUPS (SI), Z0")
	p("VMOVUPS 64(SI), Z1")
	p("VPANDD Z31, Z0, Z2")
	p("VPANDD Z31, Z1, Z3")
	p("VPMAXUD Z3, Z2, Z2") // |x| as integers orders as |x| (non-negative floats)
	reduce("VPMAXUD", 2, 3)
	p("VMOVD X2, AX")
	p("CMPL AX, $0x7f800000")
	p("JCC %s_done", name) // Inf or NaN
	p("TESTL AX, AX")
	p("JEQ %s_zero", name)
	p("CMPL AX, $0x0c000000")
	p("JCS %s_done", name) // below 2⁻¹⁰³
	p("VMOVD AX, X4")
	p("VDIVSS X30, X4, X4") // d = amax/127
	p("VDIVSS X4, X28, X5") // 1/d
	p("VBROADCASTSS X5, Z5")
	for h := range 2 {
		f, t := h, 6+h
		p("VMULPS Z5, Z%d, Z%d", f, f)
		p("VRNDSCALEPS $0x0b, Z%d, Z%d", f, t)
		p("VSUBPS Z%d, Z%d, Z%d", t, f, f)
		p("VADDPS Z%d, Z%d, Z%d", f, f, f)
		p("VRNDSCALEPS $0x0b, Z%d, Z%d", f, f)
		p("VADDPS Z%d, Z%d, Z%d", f, t, t)
		p("VMINPS Z30, Z%d, Z%d", t, t)
		p("VMAXPS Z29, Z%d, Z%d", t, t)
		p("VCVTTPS2DQ Z%d, Z%d", t, t)
	}
	p("VPADDD Z7, Z6, Z8")
	reduce("VPADDD", 8, 9)
	p("VPMOVSDB Z6, X6")
	p("VPMOVSDB Z7, X7")
	p("VINSERTI128 $1, X7, Y6, Y6")
	p("KXNORW K1, K1, K1")
	p("VPSCATTERDD Y6, K1, (DI)(Y27*1)")
	p("VMOVSS X4, (R10)")
	p("VMOVD X8, AX")
	p("IMULL $-128, AX")
	p("MOVL AX, (R11)")
	fmt.Fprintf(&out, "%s_next:\n", name)
	p("ADDQ $%d, SI", 4*group)
	p("ADDQ R12, DI")
	p("ADDQ R9, R10")
	p("ADDQ R9, R11")
	p("INCQ DX")
	p("JMP %s_loop", name)
	fmt.Fprintf(&out, "%s_zero:\n", name)
	p("VPXORD Y6, Y6, Y6")
	p("KXNORW K1, K1, K1")
	p("VPSCATTERDD Y6, K1, (DI)(Y27*1)")
	p("MOVL $0, (R10)")
	p("MOVL $0, (R11)")
	p("JMP %s_next", name)
	fmt.Fprintf(&out, "%s_done:\n", name)
	p("MOVQ DX, ret+56(FP)")
	p("VZEROUPPER")
	p("RET")
	for i := range 8 {
		fmt.Fprintf(&out, "DATA iota8<>+%d(SB)/4, $%d\n", 4*i, i)
	}
	out.WriteString("GLOBL iota8<>(SB), RODATA|NOPTR, $32\n")
}

// reduce folds the 16 dwords of Z(r) with op (VPMAXUD, VPADDD) into its lowest, using Z(t).
func reduce(op string, r, t int) {
	p("VEXTRACTI64X4 $1, Z%d, Y%d", r, t)
	p("%s Y%d, Y%d, Y%d", op, t, r, r)
	p("VEXTRACTI128 $1, Y%d, X%d", r, t)
	p("%s X%d, X%d, X%d", op, t, r, r)
	p("VPSHUFD $0x4e, X%d, X%d", r, t)
	p("%s X%d, X%d, X%d", op, t, r, r)
	p("VPSHUFD $0xb1, X%d, X%d", r, t)
	p("%s X%d, X%d, X%d", op, t, r, r)
}

func main() {
	out.WriteString("// Code generated by int8gen.go; DO NOT EDIT.\n\n//go:build amd64 && !purego\n\n#include \"textflag.h\"\n")
	for mr := 1; mr <= tileRows; mr++ {
		tile(mr)
	}
	tile2()
	quant()
	if err := os.WriteFile("int8_amd64.s", out.Bytes(), 0o644); err != nil {
		log.Fatal(err)
	}
}
