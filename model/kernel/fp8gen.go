//go:build ignore

// fp8gen writes fp8_amd64.s, the AVX-512 conversions between FP8 KV codes and float32 (see
// fp8.go), and the widening to bfloat16 of bfloat16-exact tables (see fp8bf16.go). Run it with `go generate` (see fp8_amd64.go) after changing it; the generated file is
// checked in.
//
// Widening with AVX-512 VBMI looks the codes up in the FP8Table's own bits, 64 codes a step (see
// widenPlanes): exact by construction, and 10 times as fast as the table lookup in Go. To
// bfloat16 it looks up only the upper two bytes.
//
// Without VBMI, widening computes 16 codes a step: VPMOVZXBD, the magnitude's exponent and
// mantissa shifted into float32's place and rebiased with one integer add (exact for every
// normal code), subnormal codes (exponent 0, ±0 included) rebiased one binade higher and that
// binade's lowest value subtracted in float32 (exact: both are multiples of the smallest
// subnormal, below 2^24 of them), NaN and infinity codes patched by compare masks, the sign
// merged, then the one float32 multiply by the scale that NewFP8Table makes: the same bits as the
// table, with no float32 subnormal operand on the way (3 times as fast as the Go lookup).
//
// Narrowing is FromF32 of x ÷ scale lane by lane: the same division, clamp, float32 round for
// underflows and integer round to nearest even for the rest.
package main

import (
	"bytes"
	"fmt"
	"log"
	"os"
)

var out bytes.Buffer

func p(format string, args ...any) { fmt.Fprintf(&out, "\t"+format+"\n", args...) }

// format is one FP8 format's constants.
type format struct {
	name string
	mant uint32 // mantissa bits
	bias uint32 // exponent bias
	// special reports the codes whose magnitude m is NaN or infinite: VPCMPUD predicate
	// specialPred of m against specialCode. patch ORs specialBits into their widened bits, else
	// (E4M3's single NaN) specialBits replaces them: ToF32's own results.
	specialPred, specialCode, specialBits uint32
	patch                                 bool
	maxBits                               uint32 // float32 bits of the largest finite value
}

var formats = []format{
	{name: "E4M3", mant: 3, bias: 7, specialPred: 0, specialCode: 0x7f, specialBits: 0x7fc00000, maxBits: 0x43e00000},
	{name: "E5M2", mant: 2, bias: 15, specialPred: 5, specialCode: 0x7c, specialBits: 0x7f800000, patch: true, maxBits: 0x47600000},
}

// broadcast loads the 32-bit constant v into every lane of Z<reg>.
func broadcast(v uint32, reg int) {
	p("MOVL $0x%08x, AX", v)
	p("VPBROADCASTD AX, Z%d", reg)
}

// widenStep widens the 16 codes at off(SI) (under mask k when k > 0) into off*4(DI), using
// Z<r> and Z<r+1>.
func widenStep(f format, off, r, k int) {
	a, m := fmt.Sprintf("Z%d", r), fmt.Sprintf("Z%d", r+1)
	if k > 0 {
		p("VPMOVZXBD.Z %d(SI), K%d, %s", off, k, a)
	} else {
		p("VPMOVZXBD %d(SI), %s", off, a)
	}
	p("VPANDD Z16, %s, %s", a, m)                   // magnitude code
	p("VPCMPUD $1, Z17, %s, K1", m)                 // below the smallest normal: subnormal or zero
	p("VPCMPUD $%d, Z18, %s, K2", f.specialPred, m) // NaN or infinity
	p("VPSLLD $%d, %s, %s", 23-f.mant, m, m)
	p("VPADDD Z19, %s, %s", m, m)
	p("VPADDD Z20, %s, K1, %s", m, m)
	p("VSUBPS Z21, %s, K1, %s", m, m)
	if f.patch {
		p("VPORD Z22, %s, K2, %s", m, m)
	} else {
		p("VMOVDQA32 Z22, K2, %s", m)
	}
	p("VPSLLD $24, %s, %s", a, a)
	p("VPTERNLOGD $0xd8, Z23, %s, %s", a, m) // the sign bit from the code, the rest from m
	p("VMULPS Z24, %s, %s", m, m)
	if k > 0 {
		p("VMOVUPS %s, K%d, %d(DI)", m, k, 4*off)
	} else {
		p("VMOVUPS %s, %d(DI)", m, 4*off)
	}
}

// widen writes widen<name>: n codes from src into dst, times scale.
func widen(f format) {
	name := "widen" + f.name
	fmt.Fprintf(&out, "\n// func %s(dst *float32, src *uint8, n int, scale float32)\n", name)
	fmt.Fprintf(&out, "TEXT ·%s(SB), NOSPLIT, $0-28\n", name)
	p("MOVQ dst+0(FP), DI")
	p("MOVQ src+8(FP), SI")
	p("MOVQ n+16(FP), CX")
	p("VBROADCASTSS scale+24(FP), Z24")
	broadcast(0x7f, 16)
	broadcast(1<<(f.mant), 17)
	broadcast(f.specialCode, 18)
	broadcast((127-f.bias)<<23, 19)
	broadcast(1<<23, 20)
	broadcast((128-f.bias)<<23, 21) // the binade subnormal codes are widened into
	broadcast(f.specialBits, 22)
	broadcast(0x80000000, 23)
	const unroll = 4
	fmt.Fprintf(&out, "%s_loop%d:\n", name, 16*unroll)
	p("CMPQ CX, $%d", 16*unroll)
	p("JLT %s_loop16", name)
	for u := range unroll {
		widenStep(f, 16*u, 2*u, 0)
	}
	p("ADDQ $%d, SI", 16*unroll)
	p("ADDQ $%d, DI", 64*unroll)
	p("SUBQ $%d, CX", 16*unroll)
	p("JMP %s_loop%d", name, 16*unroll)
	fmt.Fprintf(&out, "%s_loop16:\n", name)
	p("CMPQ CX, $16")
	p("JLT %s_tail", name)
	widenStep(f, 0, 0, 0)
	p("ADDQ $16, SI")
	p("ADDQ $64, DI")
	p("SUBQ $16, CX")
	p("JMP %s_loop16", name)
	fmt.Fprintf(&out, "%s_tail:\n", name)
	p("TESTQ CX, CX")
	p("JZ %s_done", name)
	tailMask(3)
	widenStep(f, 0, 0, 3)
	fmt.Fprintf(&out, "%s_done:\n", name)
	p("VZEROUPPER")
	p("RET")
}

// tailMask sets K<k> to the low CX (1..15) lanes.
func tailMask(k int) {
	p("MOVL $1, AX")
	p("SHLL CX, AX")
	p("DECL AX")
	p("KMOVW AX, K%d", k)
}

// narrowStep narrows the 16 float32s at off*4(SI) (under mask k when k > 0) into off(DI),
// using Z<r>..Z<r+2>.
func narrowStep(f format, off, r, k int) {
	q, s, o := fmt.Sprintf("Z%d", r), fmt.Sprintf("Z%d", r+1), fmt.Sprintf("Z%d", r+2)
	if k > 0 {
		p("VMOVUPS.Z %d(SI), K%d, %s", 4*off, k, q)
	} else {
		p("VMOVUPS %d(SI), %s", 4*off, q)
	}
	p("VDIVPS Z24, %s, %s", q, q)
	p("VPSRLD $24, %s, %s", q, s) // the sign in bit 7
	p("VPANDD Z16, %s, %s", q, q)
	p("VPCMPUD $6, Z17, %s, K1", q) // NaN
	p("VPMINUD Z18, %s, %s", q, q)  // saturate
	p("VPCMPUD $1, Z19, %s, K2", q) // below the smallest normal
	shift := 23 - f.mant
	// Normal: rebias and round to nearest even as FromF32 does, adding half the dropped range
	// less one plus the kept mantissa's last bit.
	p("VPSRLD $%d, %s, %s", shift, q, o)
	p("VPANDD Z20, %s, %s", o, o)
	p("VPADDD Z21, %s, %s", o, o)
	p("VPADDD %s, %s, %s", q, o, o)
	p("VPSRLD $%d, %s, %s", shift, o, o)
	// Underflows: rounded by a float32 addition of the magic power of two, whose spacing is the
	// smallest subnormal; the code is what the sum holds above the magic, its low byte (the
	// magic's is 0).
	p("VADDPS Z22, %s, K2, %s", q, o)
	p("VMOVDQA32 Z23, K1, %s", o)
	p("VPTERNLOGD $0xd8, Z25, %s, %s", s, o) // bit 7 from s, the rest from o
	if k > 0 {
		p("VPMOVDB %s, K%d, %d(DI)", o, k, off)
	} else {
		p("VPMOVDB %s, %d(DI)", o, off)
	}
}

// narrow writes narrow<name>: the n codes of src ÷ scale into dst.
func narrow(f format) {
	name := "narrow" + f.name
	fmt.Fprintf(&out, "\n// func %s(dst *uint8, src *float32, n int, scale float32)\n", name)
	fmt.Fprintf(&out, "TEXT ·%s(SB), NOSPLIT, $0-28\n", name)
	p("MOVQ dst+0(FP), DI")
	p("MOVQ src+8(FP), SI")
	p("MOVQ n+16(FP), CX")
	p("VBROADCASTSS scale+24(FP), Z24")
	shift := 23 - f.mant
	broadcast(0x7fffffff, 16)
	broadcast(0x7f800000, 17)
	broadcast(f.maxBits, 18)
	broadcast((128-f.bias)<<23, 19) // the smallest normal
	broadcast(1, 20)
	broadcast((f.bias-127)<<23+(1<<(shift-1)-1), 21)
	broadcast((151-f.bias-f.mant)<<23, 22) // the magic: its spacing is the smallest subnormal
	broadcast(0x7f, 23)
	broadcast(0x80, 25)
	fmt.Fprintf(&out, "%s_loop:\n", name)
	p("CMPQ CX, $16")
	p("JLT %s_tail", name)
	narrowStep(f, 0, 0, 0)
	p("ADDQ $64, SI")
	p("ADDQ $16, DI")
	p("SUBQ $16, CX")
	p("JMP %s_loop", name)
	fmt.Fprintf(&out, "%s_tail:\n", name)
	p("TESTQ CX, CX")
	p("JZ %s_done", name)
	tailMask(3)
	narrowStep(f, 0, 0, 3)
	fmt.Fprintf(&out, "%s_done:\n", name)
	p("VZEROUPPER")
	p("RET")
}

// widenPlanes writes a widening of n codes from src into dst looked up in an FP8Table's byte
// planes (plane k holds byte k of the float32 of each code below 0x80; a code with bit 7 set is
// the same value negated, its sign bit flipped): planes 4, widenFP8VBMI, the whole float32s;
// planes 2, widenFP8BF16VBMI, their upper halves (planes 2 and 3), which are the bfloat16 bits of
// a bfloat16-exact table's values (fp8bf16.go). Per 64 codes: VPERMB puts them in the order the
// unpacking below undoes, VPERMI2B looks up each byte of their values (128-entry tables, the
// code's low 7 bits), VPTERNLOGD flips the top bytes' sign bits by the codes' bit 7, and byte
// (then, for float32, word) unpacks interleave the planes into 64 values, stored in order.
func widenPlanes(planes int) {
	name, perm, dstType, store := "widenFP8VBMI", "fp8perm", "float32", "VMOVDQU32"
	if planes == 2 {
		name, perm, dstType, store = "widenFP8BF16VBMI", "fp8bf16perm", "uint16", "VMOVDQU16"
	}
	// Unpacking lane L (16 bytes) of the planes yields the values of plane positions 16L+e·r+i
	// (i < e, e = 16/planes values a lane) in stored register r at lane L, stored as values
	// (64/planes)·r + e·L + i: so plane position 16L+e·r+i must hold that code.
	e := 16 / planes
	var order [64]byte
	for l := range 4 {
		for r := range planes {
			for i := range e {
				order[16*l+e*r+i] = byte(64/planes*r + e*l + i)
			}
		}
	}
	for j := 0; j < 64; j += 8 {
		var v uint64
		for b := range 8 {
			v |= uint64(order[j+b]) << (8 * b)
		}
		fmt.Fprintf(&out, "DATA %s<>+%d(SB)/8, $0x%016x\n", perm, j, v)
	}
	fmt.Fprintf(&out, "GLOBL %s<>(SB), RODATA|NOPTR, $64\n", perm)
	fmt.Fprintf(&out, "\n// func %s(dst *%s, src *uint8, n int, planes *[4][128]uint8)\n", name, dstType)
	fmt.Fprintf(&out, "TEXT ·%s(SB), NOSPLIT, $0-32\n", name)
	p("MOVQ dst+0(FP), DI")
	p("MOVQ src+8(FP), SI")
	p("MOVQ n+16(FP), CX")
	p("MOVQ planes+24(FP), AX")
	// The planes used (the last ones): two registers of 64 bytes each, from Z8 on.
	for z := range 2 * planes {
		p("VMOVDQU64 %d(AX), Z%d", 128*(4-planes)+64*z, 8+z)
	}
	p("VMOVDQU64 %s<>(SB), Z16", perm)
	p("MOVL $0x80808080, AX")
	p("VPBROADCASTD AX, Z17")
	// The registers stored: the byte unpacks' for two planes, the word unpacks' for four.
	stored := []int{3, 4}
	if planes == 4 {
		stored = []int{19, 20, 21, 22}
	}
	step := func(masked bool) {
		if masked {
			p("VMOVDQU8.Z (SI), K1, Z0")
		} else {
			p("VMOVDQU64 (SI), Z0")
		}
		p("VPERMB Z0, Z16, Z0")
		for k := range planes {
			p("VMOVDQA64 Z0, Z%d", 1+k)
			p("VPERMI2B Z%d, Z%d, Z%d", 9+2*k, 8+2*k, 1+k)
		}
		p("VPTERNLOGD $0x78, Z17, Z0, Z%d", planes) // the top plane ^= Z0 & 0x80…: the sign
		if planes == 2 {
			p("VPUNPCKLBW Z2, Z1, Z3")
			p("VPUNPCKHBW Z2, Z1, Z4")
		} else {
			p("VPUNPCKLBW Z2, Z1, Z5")
			p("VPUNPCKHBW Z2, Z1, Z6")
			p("VPUNPCKLBW Z4, Z3, Z7")
			p("VPUNPCKHBW Z4, Z3, Z18")
			p("VPUNPCKLWD Z7, Z5, Z19")
			p("VPUNPCKHWD Z7, Z5, Z20")
			p("VPUNPCKLWD Z18, Z6, Z21")
			p("VPUNPCKHWD Z18, Z6, Z22")
		}
		for r, z := range stored {
			if masked {
				p("%s Z%d, K%d, %d(DI)", store, z, 2+r, 64*r)
			} else {
				p("%s Z%d, %d(DI)", store, z, 64*r)
			}
		}
	}
	fmt.Fprintf(&out, "%s_loop:\n", name)
	p("CMPQ CX, $64")
	p("JLT %s_tail", name)
	step(false)
	p("ADDQ $64, SI")
	p("ADDQ $%d, DI", 64*planes)
	p("SUBQ $64, CX")
	p("JMP %s_loop", name)
	fmt.Fprintf(&out, "%s_tail:\n", name)
	p("TESTQ CX, CX")
	p("JZ %s_done", name)
	p("MOVQ $1, AX")
	p("SHLQ CX, AX")
	p("DECQ AX")
	p("KMOVQ AX, K1")
	// Each store's mask: 64/planes bits of the codes' mask in turn.
	kmov := map[int]string{2: "KMOVD", 4: "KMOVW"}[planes]
	for r := range planes {
		p("%s AX, K%d", kmov, 2+r)
		if r < planes-1 {
			p("SHRQ $%d, AX", 64/planes)
		}
	}
	step(true)
	fmt.Fprintf(&out, "%s_done:\n", name)
	p("VZEROUPPER")
	p("RET")
}

func main() {
	out.WriteString("// Code generated by fp8gen.go; DO NOT EDIT.\n\n//go:build amd64 && !purego\n\n#include \"textflag.h\"\n\n")
	widenPlanes(4)
	widenPlanes(2)
	for _, f := range formats {
		widen(f)
		narrow(f)
	}
	if err := os.WriteFile("fp8_amd64.s", out.Bytes(), 0o644); err != nil {
		log.Fatal(err)
	}
}
