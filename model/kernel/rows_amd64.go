//go:build amd64 && !purego

package kernel

import "unsafe"

//go:generate go run rowsgen.go

// rowDotsRows is the most query rows a row-dots kernel call takes (the size of its stack
// buffer of running sums).
const rowDotsRows = 32

// rowDotsTmp is the size, in floats, of the row-dots kernels' stack buffer: the largest grouped
// kernel's, 3 groups' transposed keys (256 floats each) and 4 groups' running sums of
// rowDotsRows rows (16 floats a row and group).
const rowDotsTmp = 3*256 + rowDotsRows*16*4

// rowDotsGroupsBF16 and rowDotsGroupsF32 are the most groups of 16 keys a scores kernel call
// takes for bfloat16 and float32 keys: with 2 query rows (decode's) the 4-group bfloat16 kernel
// ran 1.8× the single-group one's keys a CPU second in L1, the 2-group one 1.5×; for float32,
// twice the transposing per dimension, 4 groups ran no faster than 2 (1.4–1.5×).
const (
	rowDotsGroupsBF16 = 4
	rowDotsGroupsF32  = 2
)

// rowDotsGroupArgs holds the pointers of a grouped scores kernel's groups (rows_amd64.s): keys,
// query rows and score rows, in that order.
type rowDotsGroupArgs struct {
	k      [4]unsafe.Pointer
	q, dst [4]*float32
}

// rowDotsBatch gathers single-group scores problems (16 keys, or fewer, of the same rows, dim
// and strides) and runs every four whole groups in one call of the 4-group kernel, a remaining
// two in the 2-group one, the rest (and partial groups) with the single-group kernels — the
// same chains in every case, so the same bits. A batch lives on its caller's stack.
type rowDotsBatch struct {
	args                     rowDotsGroupArgs
	n                        int // groups in args
	most                     int // the most groups a call takes (1, 2 or 4)
	bf16, pairs              bool
	ldd, ldq, rows, ldk, dim int
	tmp                      [rowDotsTmp]float32
}

// start readies b for problems of bfloat16 (bf16) or float32 keys with these strides and dim, at
// most most (1, 2 or 4) groups a kernel call; b.rows is set by the caller before it adds
// problems.
func (b *rowDotsBatch) start(bf16 bool, most, ldd, ldq, ldk, dim int) {
	b.bf16, b.pairs, b.most = bf16, dim%32 == 0, most
	b.ldd, b.ldq, b.ldk, b.dim = ldd, ldq, ldk, dim
	if bf16 && !b.pairs {
		b.most = 1 // no grouped kernel of single bfloat16 values
	}
}

// add adds the scores of b.rows query rows at q (ldq apart) against nk ≤ 16 keys at k (ldk
// elements apart) into dst (ldd apart), run now or with the next groups.
func (b *rowDotsBatch) add(dst, q *float32, k unsafe.Pointer, nk int) {
	if nk < 16 || b.most < 2 {
		b.single(dst, q, k, nk)
		return
	}
	b.args.k[b.n], b.args.q[b.n], b.args.dst[b.n] = k, q, dst
	b.n++
	if b.n < b.most {
		return
	}
	rowDotsGroups(b.most, b.bf16, &b.args, b.ldd, b.ldq, b.rows, b.ldk, b.dim, &b.tmp[0])
	b.n = 0
}

// flush runs the groups b holds: two in one call, a last one alone.
func (b *rowDotsBatch) flush() {
	i := 0
	if b.n-i >= 2 {
		rowDotsGroups(2, b.bf16, &b.args, b.ldd, b.ldq, b.rows, b.ldk, b.dim, &b.tmp[0])
		i = 2
	}
	if i < b.n {
		b.single(b.args.dst[i], b.args.q[i], b.args.k[i], 16)
	}
	b.n = 0
}

// single runs one group of nk ≤ 16 keys with the single-group kernels.
func (b *rowDotsBatch) single(dst, q *float32, k unsafe.Pointer, nk int) {
	switch {
	case !b.bf16:
		rowDots512(dst, b.ldd, q, b.ldq, b.rows, (*float32)(k), b.ldk, nk, b.dim, &b.tmp[0])
	case b.pairs:
		rowDotsBF16p512(dst, b.ldd, q, b.ldq, b.rows, (*uint16)(k), b.ldk, nk, b.dim, &b.tmp[0])
	default:
		rowDotsBF16x512(dst, b.ldd, q, b.ldq, b.rows, (*uint16)(k), b.ldk, nk, b.dim, &b.tmp[0])
	}
}

// rowDotsGroups runs the grouped scores kernel of groups (2 or 4) groups of 16 keys of bfloat16
// (bf16) or float32 keys on args' first groups. The kernels are called directly, not through a
// func value, so that args and tmp stay on the caller's stack.
func rowDotsGroups(groups int, bf16 bool, args *rowDotsGroupArgs, ldd, ldq, rows, ldk, dim int, tmp *float32) {
	switch {
	case groups == 2 && bf16:
		rowDotsBF16p512g2(args, ldd, ldq, rows, ldk, dim, tmp)
	case groups == 2:
		rowDots512g2(args, ldd, ldq, rows, ldk, dim, tmp)
	case groups == 4 && bf16:
		rowDotsBF16p512g4(args, ldd, ldq, rows, ldk, dim, tmp)
	case groups == 4:
		rowDots512g4(args, ldd, ldq, rows, ldk, dim, tmp)
	default:
		panic("kernel: bad number of score groups")
	}
}

//go:noescape
func rowDots512g2(args *rowDotsGroupArgs, ldd int, ldq int, rows int, ldk int, dim int, tmp *float32)

//go:noescape
func rowDots512g4(args *rowDotsGroupArgs, ldd int, ldq int, rows int, ldk int, dim int, tmp *float32)

//go:noescape
func rowDotsBF16p512g2(args *rowDotsGroupArgs, ldd int, ldq int, rows int, ldk int, dim int, tmp *float32)

//go:noescape
func rowDotsBF16p512g4(args *rowDotsGroupArgs, ldd int, ldq int, rows int, ldk int, dim int, tmp *float32)
