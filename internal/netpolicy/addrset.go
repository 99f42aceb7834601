package netpolicy

import (
	"encoding/binary"
	"math/bits"
	"net/netip"
	"slices"
	"strings"
	"sync"
)

// This file is exact set arithmetic over address space, for Subset: a set
// of addresses is a sorted list of disjoint inclusive ranges per family,
// so a /16 covered by two /17s is a subset by construction, not by
// sampling.

// u128 is an address as a number (an IPv4 address in lo's low 32 bits).
type u128 struct{ hi, lo uint64 }

func (a u128) cmp(b u128) int {
	switch {
	case a.hi < b.hi:
		return -1
	case a.hi > b.hi:
		return 1
	case a.lo < b.lo:
		return -1
	case a.lo > b.lo:
		return 1
	}
	return 0
}

func (a u128) addOne() u128 {
	lo, carry := bits.Add64(a.lo, 1, 0)
	return u128{a.hi + carry, lo}
}

func (a u128) subOne() u128 {
	lo, borrow := bits.Sub64(a.lo, 1, 0)
	return u128{a.hi - borrow, lo}
}

func (a u128) or(b u128) u128 { return u128{a.hi | b.hi, a.lo | b.lo} }

// lowMask has the low n bits set (0 ≤ n ≤ 128).
func lowMask(n int) u128 {
	switch {
	case n <= 0:
		return u128{}
	case n < 64:
		return u128{0, 1<<n - 1}
	case n == 64:
		return u128{0, ^uint64(0)}
	case n < 128:
		return u128{1<<(n-64) - 1, ^uint64(0)}
	}
	return u128{^uint64(0), ^uint64(0)}
}

var (
	max4 = u128{0, 1<<32 - 1}
	max6 = u128{^uint64(0), ^uint64(0)}
)

// span is an inclusive range of one family.
type span struct{ lo, hi u128 }

// spans is sorted, disjoint and never adjacent (adjacent ranges are
// merged), so equal sets have equal representations.
type spans []span

// addrSet is a set of addresses: IPv4 and IPv6 kept apart, as netip does
// (an IPv4-mapped IPv6 address is an IPv6 address here).
type addrSet struct{ v4, v6 spans }

func addrKey(a netip.Addr) (bool, u128) {
	if a.Is4() {
		b := a.As4()
		return false, u128{0, uint64(binary.BigEndian.Uint32(b[:]))}
	}
	b := a.As16()
	return true, u128{binary.BigEndian.Uint64(b[:8]), binary.BigEndian.Uint64(b[8:])}
}

func keyAddr(v6 bool, k u128) netip.Addr {
	if !v6 {
		var b [4]byte
		binary.BigEndian.PutUint32(b[:], uint32(k.lo))
		return netip.AddrFrom4(b)
	}
	var b [16]byte
	binary.BigEndian.PutUint64(b[:8], k.hi)
	binary.BigEndian.PutUint64(b[8:], k.lo)
	return netip.AddrFrom16(b)
}

// prefixSpan is the range of a prefix.
func prefixSpan(p netip.Prefix) (bool, span) {
	p = p.Masked()
	v6, lo := addrKey(p.Addr())
	return v6, span{lo, lo.or(lowMask(p.Addr().BitLen() - p.Bits()))}
}

func prefixSet(p netip.Prefix) addrSet {
	v6, s := prefixSpan(p)
	if v6 {
		return addrSet{v6: spans{s}}
	}
	return addrSet{v4: spans{s}}
}

// normalize sorts s and merges overlapping and adjacent ranges.
func normalize(s []span, max u128) spans {
	if len(s) == 0 {
		return nil
	}
	slices.SortFunc(s, func(a, b span) int { return a.lo.cmp(b.lo) })
	out := spans{s[0]}
	for _, x := range s[1:] {
		last := &out[len(out)-1]
		if last.hi == max || x.lo.cmp(last.hi.addOne()) <= 0 {
			if x.hi.cmp(last.hi) > 0 {
				last.hi = x.hi
			}
			continue
		}
		out = append(out, x)
	}
	return out
}

// unionSpans merges two normalized lists in one pass.
func unionSpans(a, b spans, max u128) spans {
	if len(b) == 0 {
		return a
	}
	if len(a) == 0 {
		return b
	}
	out := make(spans, 0, len(a)+len(b))
	push := func(x span) {
		if n := len(out); n > 0 {
			last := &out[n-1]
			if last.hi == max || x.lo.cmp(last.hi.addOne()) <= 0 {
				if x.hi.cmp(last.hi) > 0 {
					last.hi = x.hi
				}
				return
			}
		}
		out = append(out, x)
	}
	i, j := 0, 0
	for i < len(a) || j < len(b) {
		if j == len(b) || i < len(a) && a[i].lo.cmp(b[j].lo) <= 0 {
			push(a[i])
			i++
		} else {
			push(b[j])
			j++
		}
	}
	return out
}

// intersectSpans walks both lists, or when one is much shorter looks each
// of its ranges up in the other (a policy entry against a large set).
func intersectSpans(a, b spans) spans {
	if len(a) > len(b) {
		a, b = b, a
	}
	if len(a) == 0 {
		return nil
	}
	if len(a)*16 < len(b) {
		var out spans
		for _, x := range a {
			j, _ := slices.BinarySearchFunc(b, x.lo, func(s span, lo u128) int { return s.hi.cmp(lo) })
			for ; j < len(b) && b[j].lo.cmp(x.hi) <= 0; j++ {
				lo, hi := b[j].lo, b[j].hi
				if x.lo.cmp(lo) > 0 {
					lo = x.lo
				}
				if x.hi.cmp(hi) < 0 {
					hi = x.hi
				}
				out = append(out, span{lo, hi})
			}
		}
		return out
	}
	var out spans
	for i, j := 0, 0; i < len(a) && j < len(b); {
		lo, hi := a[i].lo, a[i].hi
		if b[j].lo.cmp(lo) > 0 {
			lo = b[j].lo
		}
		if b[j].hi.cmp(hi) < 0 {
			hi = b[j].hi
		}
		if lo.cmp(hi) <= 0 {
			out = append(out, span{lo, hi})
		}
		if a[i].hi.cmp(b[j].hi) < 0 {
			i++
		} else {
			j++
		}
	}
	return out
}

func subtractSpans(a, b spans) spans {
	var out spans
	j := 0
	jump := len(a)*16 < len(b) // few ranges out of many: look them up
	for _, x := range a {
		lo := x.lo
		if jump {
			k, _ := slices.BinarySearchFunc(b[j:], lo, func(s span, lo u128) int { return s.hi.cmp(lo) })
			j += k
		}
		for j < len(b) && b[j].hi.cmp(lo) < 0 {
			j++
		}
		k := j
		done := false
		for ; k < len(b) && b[k].lo.cmp(x.hi) <= 0; k++ {
			if b[k].lo.cmp(lo) > 0 {
				out = append(out, span{lo, b[k].lo.subOne()})
			}
			if b[k].hi.cmp(x.hi) >= 0 {
				done = true
				break
			}
			lo = b[k].hi.addOne()
		}
		if !done {
			out = append(out, span{lo, x.hi})
		}
	}
	return out
}

func (s addrSet) empty() bool { return len(s.v4) == 0 && len(s.v6) == 0 }

func (s addrSet) union(t addrSet) addrSet {
	return addrSet{unionSpans(s.v4, t.v4, max4), unionSpans(s.v6, t.v6, max6)}
}

func (s addrSet) intersect(t addrSet) addrSet {
	return addrSet{intersectSpans(s.v4, t.v4), intersectSpans(s.v6, t.v6)}
}

func (s addrSet) minus(t addrSet) addrSet {
	return addrSet{subtractSpans(s.v4, t.v4), subtractSpans(s.v6, t.v6)}
}

// unionAll is the union of many (unsorted, overlapping) sets.
func unionAll(sets []addrSet) addrSet {
	var v4, v6 []span
	for _, s := range sets {
		v4 = append(v4, s.v4...)
		v6 = append(v6, s.v6...)
	}
	return addrSet{normalize(v4, max4), normalize(v6, max6)}
}

var allAddrs = addrSet{spans{{u128{}, max4}}, spans{{u128{}, max6}}}

// first is the lowest address of a non-empty set.
func (s addrSet) first() netip.Addr {
	if len(s.v4) > 0 {
		return keyAddr(false, s.v4[0].lo)
	}
	return keyAddr(true, s.v6[0].lo)
}

// Where IPv6 forms embed an IPv4 address (see embeddedV4): the range of
// the form for an IPv4 range.
func embedMapped(s span) span {
	return span{u128{0, 0xffff<<32 | s.lo.lo}, u128{0, 0xffff<<32 | s.hi.lo}}
}
func embedCompat(s span) span { return span{u128{0, s.lo.lo}, u128{0, s.hi.lo}} }
func embedNAT64(s span) span {
	const hi = 0x0064_ff9b << 32
	return span{u128{hi, s.lo.lo}, u128{hi, s.hi.lo}}
}
func embed6to4(s span) span {
	const top = 0x2002 << 48
	return span{u128{top | s.lo.lo<<16, 0}, u128{top | s.hi.lo<<16 | 0xffff, ^uint64(0)}}
}

var (
	mapped6Set = prefixSet(mapped6)
	// compat6 minus :: and ::1, which embeddedV4 does not treat as
	// embedding an address.
	compatEmbedSet = prefixSet(compat6).minus(addrSet{v6: spans{{u128{}, u128{0, 1}}}})
)

// allowFootprint: the connection addresses (as the sandbox writes them)
// an allow_out prefix or AllowPrivate range matches. Check compares the
// unmapped address, so an IPv4 prefix also matches its IPv4-mapped form
// and an IPv6 prefix never matches the IPv4-mapped range.
func allowFootprint(p netip.Prefix) addrSet {
	v6, s := prefixSpan(p)
	if v6 {
		return addrSet{v6: spans{s}}.minus(mapped6Set)
	}
	return addrSet{v4: spans{s}, v6: spans{embedMapped(s)}}
}

// denyFootprint: the connection addresses a deny_out prefix matches.
// Check matches it against the address, its unmapped form and the IPv4
// address any IPv6 form embeds.
func denyFootprint(p netip.Prefix) addrSet {
	v6, s := prefixSpan(p)
	if v6 {
		return addrSet{v6: spans{s}}
	}
	emb := normalize([]span{embedMapped(s), embedNAT64(s), embed6to4(s)}, max6)
	compat := addrSet{v6: spans{embedCompat(s)}}.intersect(compatEmbedSet)
	return addrSet{v4: spans{s}, v6: unionSpans(emb, compat.v6, max6)}
}

// specialSet is every address Classify calls special. It is computed
// from Classify itself: the ranges below cut address space into pieces on
// each of which Classify's answer cannot change (every range it looks at,
// in every form), and each piece is classified by its first address.
var specialSet = sync.OnceValue(func() addrSet {
	var cuts4, cuts6 []span
	add := func(p netip.Prefix) {
		v6, s := prefixSpan(p)
		if v6 {
			cuts6 = append(cuts6, s)
			return
		}
		cuts4 = append(cuts4, s)
		cuts6 = append(cuts6, embedMapped(s), embedCompat(s), embedNAT64(s), embed6to4(s))
	}
	for _, s := range v4Special {
		add(s.prefix)
	}
	for _, s := range v6Special {
		add(s.prefix)
	}
	for _, p := range []netip.Prefix{globalUnicast6, mapped6, compat6, nat646, sixToFour6, netip.MustParsePrefix("::/127")} {
		add(p)
	}
	piece := func(cuts []span, v6 bool, max u128) spans {
		// Every range start and every range end+1 starts a piece.
		starts := []u128{{}}
		for _, c := range cuts {
			starts = append(starts, c.lo)
			if c.hi != max {
				starts = append(starts, c.hi.addOne())
			}
		}
		slices.SortFunc(starts, u128.cmp)
		starts = slices.Compact(starts)
		var out []span
		for i, st := range starts {
			end := max
			if i+1 < len(starts) {
				end = starts[i+1].subOne()
			}
			if Classify(keyAddr(v6, st)) != "" {
				out = append(out, span{st, end})
			}
		}
		return normalize(out, max)
	}
	return addrSet{piece(cuts4, false, max4), piece(cuts6, true, max6)}
})

// rangePrefixes covers the range [lo, hi] with the fewest prefixes.
func rangePrefixes(v6 bool, s span) []netip.Prefix {
	width := 32
	max := max4
	if v6 {
		width, max = 128, max6
	}
	var out []netip.Prefix
	lo := s.lo
	for {
		// The largest block starting at lo that ends at or before hi.
		host := 0
		for host < width {
			m := lowMask(host + 1)
			if (u128{lo.hi & m.hi, lo.lo & m.lo}) != (u128{}) {
				break
			}
			if lo.or(m).cmp(s.hi) > 0 {
				break
			}
			host++
		}
		out = append(out, netip.PrefixFrom(keyAddr(v6, lo), width-host))
		end := lo.or(lowMask(host))
		if end.cmp(s.hi) >= 0 || end == max {
			return out
		}
		lo = end.addOne()
	}
}

// describe writes at most n of s's ranges as CIDRs: IPv4 and plain IPv6
// ranges, and the IPv6 forms that embed an IPv4 address (which mostly
// repeat the IPv4 ranges) only if there is nothing else.
func (s addrSet) describe(n int) string {
	emb := mapped6Set.union(prefixSet(compat6)).union(prefixSet(nat646)).union(prefixSet(sixToFour6))
	var plain, embedded []string
	add := func(dst *[]string, v6 bool, l spans) {
		for _, sp := range l {
			if len(*dst) > n {
				return
			}
			for _, p := range rangePrefixes(v6, sp) {
				*dst = append(*dst, p.String())
			}
		}
	}
	add(&plain, false, s.v4)
	add(&plain, true, addrSet{v6: s.v6}.minus(emb).v6)
	add(&embedded, true, addrSet{v6: s.v6}.intersect(emb).v6)
	list, more := plain, ""
	switch {
	case len(plain) == 0:
		list = embedded
	case len(embedded) > 0:
		more = " (and IPv6 forms that embed IPv4 addresses)"
	}
	if len(list) > n {
		return strings.Join(list[:n], ", ") + " and more" + more
	}
	return strings.Join(list, ", ") + more
}
