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
	maxRows    = 3
)

// row returns the address of row m (m < 3) given the base register and the stride register.
func row(m int, base, stride string, disp int) string {
	d := ""
	if disp != 0 {
		d = fmt.Sprint(disp)
	}
	switch m {
	case 0:
		return fmt.Sprintf("%s(%s)", d, base)
	case 1:
		return fmt.Sprintf("%s(%s)(%s*1)", d, base, stride)
	}
	return fmt.Sprintf("%s(%s)(%s*2)", d, base, stride)
}

// tile writes tileI8x<mr>: mr rows × 64 columns of one int8 panel. Registers: int32 group sums
// Z(4m+v) (row m, columns 16v..16v+15), float32 chains Z(12+4m+v), weights and then the
// weight scales in Z24..Z27, temporaries Z28..Z30. Per group: each sum starts at the row's
// correction (−128·Σq, as the weights are stored as q+128 for VPDPBUSD's unsigned operand),
// takes 8 VPDPBUSD steps of 4 inputs, then the chain takes acc + float32(s)·(dw·dx).
func tile(mr int) {
	name := fmt.Sprintf("tileI8x%d", mr)
	fmt.Fprintf(&out, "\n// func %s(a *int8, lda int, d *float32, corr *int32, lds int, w *byte, groups int, c *float32, ldc int, mask uint64)\n", name)
	fmt.Fprintf(&out, "TEXT ·%s(SB), NOSPLIT, $0-80\n", name)
	p("MOVQ a+0(FP), DI")
	p("MOVQ lda+8(FP), R8")
	p("MOVQ d+16(FP), R10")
	p("MOVQ corr+24(FP), R11")
	p("MOVQ lds+32(FP), R12")
	p("SHLQ $2, R12")
	p("MOVQ w+40(FP), BX")
	p("MOVQ groups+48(FP), CX")
	for i := range 4 * mr {
		p("VPXORD Z%d, Z%d, Z%d", 12+i, 12+i, 12+i)
	}
	fmt.Fprintf(&out, "%s_loop:\n", name)
	p("PREFETCHT0 %d(BX)", 4*groupBytes)
	for m := range mr {
		p("VPBROADCASTD %s, Z%d", row(m, "R11", "R12", 0), 4*m)
		for v := 1; v < 4; v++ {
			p("VMOVDQA64 Z%d, Z%d", 4*m, 4*m+v)
		}
	}
	for q := range group / 4 {
		for v := range 4 {
			p("VMOVDQU32 %d(BX), Z%d", q*4*panel+v*64, 24+v)
		}
		for m := range mr {
			for v := range 4 {
				p("VPDPBUSD.BCST %s, Z%d, Z%d", row(m, "DI", "R8", 4*q), 24+v, 4*m+v)
			}
		}
	}
	for v := range 4 {
		p("VMOVUPS %d(BX), Z%d", group*panel+v*64, 24+v)
	}
	for m := range mr {
		p("VBROADCASTSS %s, Z28", row(m, "R10", "R12", 0))
		for v := range 4 {
			p("VMULPS Z28, Z%d, Z29", 24+v)
			p("VCVTDQ2PS Z%d, Z30", 4*m+v)
			p("VMULPS Z29, Z30, Z30")
			p("VADDPS Z30, Z%d, Z%d", 12+4*m+v, 12+4*m+v)
		}
	}
	p("ADDQ $%d, BX", groupBytes)
	p("ADDQ $%d, DI", group)
	p("ADDQ $4, R10")
	p("ADDQ $4, R11")
	p("DECQ CX")
	p("JNZ %s_loop", name)
	p("MOVQ mask+72(FP), AX")
	for v := range 4 {
		p("KMOVW AX, K%d", v+1)
		if v < 3 {
			p("SHRQ $16, AX")
		}
	}
	p("MOVQ c+56(FP), DI")
	p("MOVQ ldc+64(FP), R8")
	p("SHLQ $2, R8")
	for m := range mr {
		for v := range 4 {
			p("VMOVUPS Z%d, K%d, %s", 12+4*m+v, v+1, row(m, "DI", "R8", 64*v))
		}
	}
	p("VZEROUPPER")
	p("RET")
}

// tile2 writes tileI8x1p2: one row × two consecutive whole int8 panels (128 columns, the second
// panel groups·groupBytes after the first), the computation of tileI8x1 on each. Registers: int32
// group sums Z0..Z3 and Z4..Z7 (first and second panel), float32 chains Z12..Z15 and Z16..Z19,
// the first panel's weights and then scales in Z24..Z27, the second's in Z20..Z23, temporaries
// Z28..Z30. Two weight streams and twice the independent chains keep more of the weights in
// flight than one panel at a time.
func tile2() {
	const name = "tileI8x1p2"
	fmt.Fprintf(&out, "\n// func %s(a *int8, d *float32, corr *int32, w *byte, groups int, c *float32)\n", name)
	fmt.Fprintf(&out, "TEXT ·%s(SB), NOSPLIT, $0-48\n", name)
	p("MOVQ a+0(FP), DI")
	p("MOVQ d+8(FP), R10")
	p("MOVQ corr+16(FP), R11")
	p("MOVQ w+24(FP), BX")
	p("MOVQ groups+32(FP), CX")
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

func main() {
	out.WriteString("// Code generated by int8gen.go; DO NOT EDIT.\n\n//go:build amd64 && !purego\n\n#include \"textflag.h\"\n")
	for mr := 1; mr <= maxRows; mr++ {
		tile(mr)
	}
	tile2()
	if err := os.WriteFile("int8_amd64.s", out.Bytes(), 0o644); err != nil {
		log.Fatal(err)
	}
}
