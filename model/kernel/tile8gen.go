//go:build ignore

// tile8gen writes tile8_amd64.s: the tall whole-panel tile of bfloat16 products (tileDot512t7,
// 7 rows × 64 columns). Run it with `go generate` (see tile8_amd64.go) after changing it; the
// generated file is checked in.
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

// gpr numbers the general registers the memory operands use.
var gpr = map[string]int{"AX": 0, "CX": 1, "DX": 2, "BX": 3, "SI": 6, "DI": 7}

// vdpbf16psMem emits VDPBF16PS disp(base), Z(src1), Z(dst) (a full 64-byte memory operand, no
// broadcast; disp a multiple of 64 below 8192) as bytes: the Go assembler does not know
// AVX512_BF16. For each of the 16 lanes dst += src1.bf16[2j+1]·m.bf16[2j+1], then dst +=
// src1.bf16[2j]·m.bf16[2j]; the products are exact, so which operand holds the weights does not
// change a bit.
func vdpbf16psMem(dst, src1 int, base string, disp int) {
	b, ok := gpr[base]
	if !ok || disp%64 != 0 || disp < 0 || disp/64 > 127 {
		panic("vdpbf16psMem operand")
	}
	bit := func(r, i int) byte { return byte(r>>i) & 1 }
	p0 := (1-bit(dst, 3))<<7 | 1<<6 | 1<<5 | (1-bit(dst, 4))<<4 | 0b10
	p1 := byte(^src1&15)<<3 | 1<<2 | 2
	p2 := byte(2)<<5 | (1-bit(src1, 4))<<3
	mod := byte(1) // disp8 (compressed by 64); also for disp 0, which keeps every base legal
	bs := []byte{0x62, p0, p1, p2, 0x52, mod<<6 | byte(dst&7)<<3 | byte(b), byte(disp / 64)}
	var s []string
	for _, c := range bs {
		s = append(s, fmt.Sprintf("BYTE $0x%02x", c))
	}
	p("%s // VDPBF16PS %d(%s), Z%d, Z%d", strings.Join(s, "; "), disp, base, src1, dst)
}

// rowAddr returns the address of row m < 8 of a row-major matrix: rows 0–3 from DI, 4–7 from SI,
// the row stride in R8 and three strides in R9 (bytes), plus disp.
func rowAddr(m, disp int) string {
	d := ""
	if disp != 0 {
		d = fmt.Sprint(disp)
	}
	base := []string{"DI", "SI"}[m/4]
	return [4]string{
		fmt.Sprintf("%s(%s)", d, base),
		fmt.Sprintf("%s(%s)(R8*1)", d, base),
		fmt.Sprintf("%s(%s)(R8*2)", d, base),
		fmt.Sprintf("%s(%s)(R9*1)", d, base),
	}[m%4]
}

// rowPointers loads the matrix argument arg (at frame offset off) and its row stride ld (at
// ldOff, in 4-byte elements) into the registers rowAddr addresses rows by.
func rowPointers(arg string, off int, ld string, ldOff int) {
	p("MOVQ %s+%d(FP), DI", arg, off)
	p("MOVQ %s+%d(FP), R8", ld, ldOff)
	p("SHLQ $2, R8")
	p("LEAQ (R8)(R8*2), R9")
	p("LEAQ (DI)(R8*4), SI")
}

// columnMasks loads the column mask argument into K1..K4, 16 columns each.
func columnMasks() {
	p("MOVQ mask+48(FP), AX")
	for v := range 4 {
		p("KMOVW AX, K%d", v+1)
		if v < 3 {
			p("SHRQ $16, AX")
		}
	}
}

// tileDot512t7 computes 7 rows × 64 columns of a BF16 panel with bfloat16 products, with the
// arguments and chains of tileDot512xN (kernel_amd64.s; pf, pfoff and pfstep are ignored): a
// holds the rows' activation pairs (lda dwords a row), w the panel (256 bytes a pair of k), and
// every lane is one output element: zero (or c's value with cont), then one VDPBF16PS per pair
// of k, k ascending.
//
// Seven rows × four vectors are 28 accumulators (Z0–Z27), so the panel's four vectors do not
// all fit beside them and a broadcast: three go to Z28–Z30, the fourth is taken from memory by
// its VDPBF16PS (an L1 hit after the row before), and each row's pair is broadcast once into Z31
// for its four VDPBF16PS (3 + 7 + 7 loads a pair of k). One call reads each line of the panel
// once, in order, and prefetches nothing: a single sequential stream the hardware prefetchers
// follow, where the half-panel tiles take two calls over each block with the next one
// prefetched in software.
func tileDot512t7(unroll int) {
	const name, mr = "tileDot512t7", 7
	fmt.Fprintf(&out, "\n// func %s(a *uint32, lda int, w *uint16, kp int, c *float32, ldc int, mask uint64, pf *uint16, pfoff int, pfstep int, cont int)\nTEXT ·%s(SB), NOSPLIT, $0-88\n", name, name)
	p("MOVQ cont+80(FP), AX")
	p("TESTQ AX, AX")
	p("JNZ %s_cont", name)
	for i := range 28 {
		p("VPXORD Z%d, Z%d, Z%d", i, i, i)
	}
	p("JMP %s_start", name)
	label(name + "_cont")
	columnMasks()
	rowPointers("c", 32, "ldc", 40)
	for m := range mr {
		for v := range 4 {
			p("VMOVUPS.Z %s, K%d, Z%d", rowAddr(m, 64*v), v+1, 4*m+v)
		}
	}
	label(name + "_start")
	rowPointers("a", 0, "lda", 8)
	p("MOVQ w+16(FP), BX")
	p("MOVQ kp+24(FP), CX")
	step := func(j int) {
		for v := range 3 {
			p("VMOVDQU32 %d(BX), Z%d", 256*j+64*v, 28+v)
		}
		for m := range mr {
			p("VPBROADCASTD %s, Z31", rowAddr(m, 4*j))
			for v := range 3 {
				vdpbf16ps(4*m+v, 31, 28+v)
			}
			vdpbf16psMem(4*m+3, 31, "BX", 256*j+192)
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
	columnMasks()
	rowPointers("c", 32, "ldc", 40)
	for m := range mr {
		for v := range 4 {
			p("VMOVUPS Z%d, K%d, %s", 4*m+v, v+1, rowAddr(m, 64*v))
		}
	}
	p("VZEROUPPER")
	p("RET")
}

// vdpbf16ps emits VDPBF16PS Z(src2), Z(src1), Z(dst) as bytes.
func vdpbf16ps(dst, src1, src2 int) {
	bit := func(r, b int) byte { return byte(r>>b) & 1 }
	p0 := (1-bit(dst, 3))<<7 | (1-bit(src2, 4))<<6 | (1-bit(src2, 3))<<5 | (1-bit(dst, 4))<<4 | 0b10
	p1 := byte(^src1&15)<<3 | 1<<2 | 2
	p2 := byte(2)<<5 | (1-bit(src1, 4))<<3
	modrm := 0xc0 | byte(dst&7)<<3 | byte(src2&7)
	var b []string
	for _, x := range []byte{0x62, p0, p1, p2, 0x52, modrm} {
		b = append(b, fmt.Sprintf("BYTE $0x%02x", x))
	}
	p("%s // VDPBF16PS Z%d, Z%d, Z%d", strings.Join(b, "; "), src2, src1, dst)
}

func main() {
	out.WriteString("// Code generated by tile8gen.go; DO NOT EDIT.\n\n//go:build amd64 && !purego\n\n#include \"textflag.h\"\n")
	tileDot512t7(4)
	if err := os.WriteFile("tile8_amd64.s", out.Bytes(), 0o644); err != nil {
		log.Fatal(err)
	}
}
