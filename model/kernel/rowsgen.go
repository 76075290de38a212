//go:build ignore

// rowsgen writes rows_amd64.s: the scores kernels that take several groups of 16 keys a call
// (rowDots512gN, rowDotsBF16p512gN), so that decode's few query rows keep several independent
// FMA chains in flight. Run it with `go generate` (see rows_amd64.go) after changing it; the
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
func text(sig, frame string) {
	name, _, _ := strings.Cut(sig, "(")
	fmt.Fprintf(&out, "\n// func %s\nTEXT ·%s(SB), NOSPLIT, %s\n", sig, name, frame)
}

// transposeRegs16 transposes the 16×16 32-bit elements of Z0–Z15 in place, Z16–Z31 scratch:
// afterwards lane j of Z(d) holds what lane d of Z(j) held (asmgen.go's, the same
// instructions).
func transposeRegs16() {
	for i := range 8 {
		p("VUNPCKLPS Z%d, Z%d, Z%d", 2*i+1, 2*i, 16+2*i)
		p("VUNPCKHPS Z%d, Z%d, Z%d", 2*i+1, 2*i, 16+2*i+1)
	}
	for g := range 4 {
		t := 16 + 4*g
		p("VUNPCKLPD Z%d, Z%d, Z%d", t+2, t, 4*g)
		p("VUNPCKHPD Z%d, Z%d, Z%d", t+2, t, 4*g+1)
		p("VUNPCKLPD Z%d, Z%d, Z%d", t+3, t+1, 4*g+2)
		p("VUNPCKHPD Z%d, Z%d, Z%d", t+3, t+1, 4*g+3)
	}
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

// Registers of the row loops: the running sums from Z16 (row pair: row 0's groups, then row
// 1's), the odd values' mask, a stored group's reloaded keys, and the widened values.
const (
	zMask = 24
	zLoad = 25
	zEven = 26
	zOdd  = 27
)

// qRegs are the registers of the groups' query rows in the row loops (and of their score rows
// at the end).
var qRegs = []string{"R15", "BX", "DI", "R10"}

// rowDotsGroups computes groups independent row-dots problems of 16 keys each, sharing rows,
// ldq, ldk, ldd and dim: for group g, with keys k_g (key j at k_g + j·ldk elements, all 16
// present), query rows q_g and score rows dst_g (the groups' pointers in args: 4 key pointers,
// then 4 query pointers, then 4 score pointers), exactly the chains of rowDots512 (bf16 false)
// or rowDotsBF16p512 (bf16 true, dim a multiple of 32): every score one VFMADD231PS chain over d
// ascending from zero, of the same (widened) values.
//
// For every block of dimensions (16 float32, or 32 bfloat16 values in pairs) each group's 16
// keys are loaded and transposed in registers as in those kernels; all but the last group's
// transposed registers are stored in tmp (1 KB a group), the last stays in Z0–Z15. Each pair of
// rows then runs its groups' chains interleaved — for each d, one FMA per row and group — so
// with 2 rows and g groups 2·g independent chains are in flight instead of 2, whose latency,
// not the arithmetic, set the single-group kernels' time. The running sums (rows·groups·16
// floats) live in tmp after the stored keys between blocks.
//
// Registers: SI args, R11 ldq bytes, R9 ldk bytes, DX dim bytes of q, R13 tmp (stored keys),
// R12 the sums, AX the queries' offset, R8 the keys' (bfloat16: half of AX's); R15, BX, DI,
// R10 the groups' query rows in the row loops.
func rowDotsGroups(bf16 bool, groups int) {
	name, ksh := fmt.Sprintf("rowDots512g%d", groups), 2
	if bf16 {
		name, ksh = fmt.Sprintf("rowDotsBF16p512g%d", groups), 1
	}
	text(name+"(args *rowDotsGroupArgs, ldd int, ldq int, rows int, ldk int, dim int, tmp *float32)", "$0-56")
	p("MOVQ args+0(FP), SI")
	p("MOVQ ldq+16(FP), R11")
	p("SHLQ $2, R11")
	p("MOVQ ldk+32(FP), R9")
	p("SHLQ $%d, R9", ksh)
	p("MOVQ dim+40(FP), DX")
	p("SHLQ $2, DX")
	p("MOVQ tmp+48(FP), R13")
	p("LEAQ %d(R13), R12", (groups-1)*1024)
	// Zero the sums: rows·groups vectors.
	p("VPXORD Z16, Z16, Z16")
	p("MOVQ R12, R14")
	p("MOVQ rows+24(FP), CX")
	label(name + "_zero")
	for g := range groups {
		p("VMOVUPS Z16, %d(R14)", 64*g)
	}
	p("ADDQ $%d, R14", 64*groups)
	p("DECQ CX")
	p("JNZ " + name + "_zero")
	p("XORQ AX, AX")
	koff := "AX"
	if bf16 {
		p("XORQ R8, R8")
		koff = "R8"
	}

	label(name + "_block")
	for g := range groups {
		p("MOVQ %d(SI), R10", 8*g)
		for i := range 16 {
			if bf16 {
				p("VMOVDQU32 (R10)(%s*1), Z%d", koff, i)
			} else {
				p("VMOVUPS (R10)(%s*1), Z%d", koff, i)
			}
			if i < 15 {
				p("ADDQ R9, R10")
			}
		}
		transposeRegs16()
		if g < groups-1 {
			for i := range 16 {
				p("VMOVUPS Z%d, %d(R13)", i, g*1024+64*i)
			}
		}
	}
	if bf16 {
		p("MOVL $0xffff0000, R14")
		p("VPBROADCASTD R14, Z%d", zMask)
	}
	for g := range groups {
		p("MOVQ %d(SI), %s", 32+8*g, qRegs[g])
		p("ADDQ AX, %s", qRegs[g])
	}
	p("MOVQ R12, R14")
	p("MOVQ rows+24(FP), CX")
	p("CMPQ CX, $2")
	p("JLT " + name + "_row1")
	label(name + "_row2")
	rowsFMA(bf16, groups, 2)
	p("ADDQ $%d, R14", 2*64*groups)
	for g := range groups {
		p("LEAQ (%s)(R11*2), %s", qRegs[g], qRegs[g])
	}
	p("SUBQ $2, CX")
	p("CMPQ CX, $2")
	p("JGE " + name + "_row2")
	label(name + "_row1")
	p("TESTQ CX, CX")
	p("JEQ " + name + "_next")
	rowsFMA(bf16, groups, 1)
	label(name + "_next")
	if bf16 {
		p("ADDQ $128, AX")
		p("ADDQ $64, R8")
	} else {
		p("ADDQ $64, AX")
	}
	p("CMPQ AX, DX")
	p("JLT " + name + "_block")

	// Store every row's sums, 16 lanes a group.
	for g := range groups {
		p("MOVQ %d(SI), %s", 64+8*g, qRegs[g])
	}
	p("MOVQ ldd+8(FP), R8")
	p("SHLQ $2, R8")
	p("MOVQ rows+24(FP), CX")
	label(name + "_store")
	for g := range groups {
		p("VMOVUPS %d(R12), Z%d", 64*g, 16+g)
		p("VMOVUPS Z%d, (%s)", 16+g, qRegs[g])
		p("ADDQ R8, %s", qRegs[g])
	}
	p("ADDQ $%d, R12", 64*groups)
	p("DECQ CX")
	p("JNZ " + name + "_store")
	p("VZEROUPPER")
	p("RET")
}

// rowsFMA emits one block's chains for nr (1 or 2) rows, group g's queries at qRegs[g] (row 1
// R11 further) and the sums at R14: the sums are loaded, then for each d (each pair of d with
// bf16), group after group, the group's transposed keys (Z(d) for the last group, reloaded from
// tmp for the others) take one FMA per row, and the sums are stored back.
func rowsFMA(bf16 bool, groups, nr int) {
	acc := func(r, g int) int { return 16 + r*groups + g }
	for r := range nr {
		for g := range groups {
			p("VMOVUPS %d(R14), Z%d", 64*(r*groups+g), acc(r, g))
		}
	}
	qAddr := func(g, r, off int) string {
		if r == 0 {
			return fmt.Sprintf("%d(%s)", off, qRegs[g])
		}
		return fmt.Sprintf("%d(%s)(R11*1)", off, qRegs[g])
	}
	for d := range 16 {
		for g := range groups {
			key := d
			if g < groups-1 {
				p("VMOVUPS %d(R13), Z%d", g*1024+64*d, zLoad)
				key = zLoad
			}
			if !bf16 {
				for r := range nr {
					p("VFMADD231PS.BCST %s, Z%d, Z%d", qAddr(g, r, 4*d), key, acc(r, g))
				}
				continue
			}
			p("VPSLLD $16, Z%d, Z%d", key, zEven)
			for r := range nr {
				p("VFMADD231PS.BCST %s, Z%d, Z%d", qAddr(g, r, 8*d), zEven, acc(r, g))
			}
			p("VPANDD Z%d, Z%d, Z%d", zMask, key, zOdd)
			for r := range nr {
				p("VFMADD231PS.BCST %s, Z%d, Z%d", qAddr(g, r, 8*d+4), zOdd, acc(r, g))
			}
		}
	}
	for r := range nr {
		for g := range groups {
			p("VMOVUPS Z%d, %d(R14)", acc(r, g), 64*(r*groups+g))
		}
	}
}

func main() {
	out.WriteString("// Code generated by rowsgen.go; DO NOT EDIT.\n\n//go:build amd64 && !purego\n\n#include \"textflag.h\"\n")
	for _, groups := range []int{2, 4} {
		rowDotsGroups(false, groups)
		rowDotsGroups(true, groups)
	}
	if err := os.WriteFile("rows_amd64.s", out.Bytes(), 0o644); err != nil {
		log.Fatal(err)
	}
}
